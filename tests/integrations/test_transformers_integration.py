"""enable_transformers(): transformers' optim="lomo"/"adalomo" and accelerate's LOMO path."""

from __future__ import annotations

import copy
import sys
import warnings

import pytest
import torch
from support.accumulating import FP32_BOUND
from support.dependencies import require
from support.hf_trainer import (
    RecordsMicroBatches,
    args,
    big_batches,
    dataset,
    distinct_rows,
    logged,
    no_decay_on_norms,
    replay,
    trainer_batch,
)
from support.models import batch, max_rel_diff, tiny_llama
from support.state import assert_same_state

require("transformers")
from accelerate import Accelerator  # noqa: E402
from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402
from transformers import Trainer  # noqa: E402

import lomo_kernels  # noqa: E402
from lomo_kernels import AdaLomo, Lomo  # noqa: E402

LR, STEPS = 0.2, 3
OPTIONS = {"clip_grad_norm": 1.0, "weight_decay": 0.01}
CLASSES = {"lomo": Lomo, "adalomo": AdaLomo}
# The accumulation tests' max_grad_norm: below every step's norm before clipping (0.86 and
# more in these runs; the tests assert it), so the clip binds on every step.
ACCUMULATED_CLIP = 0.4


@pytest.fixture(autouse=True)
def enabled():
    lomo_kernels.enable_transformers()
    yield
    lomo_kernels.disable_transformers()


def schedule(step):
    return LR * (1 - step / STEPS)  # transformers' linear schedule without warm-up


def manual(model, cls=Lomo, batches=None, **options):
    """The reference loop: the optimizer's own fused_backward, no framework."""
    opt = cls(model, lr=LR, **options)
    norms = []
    for step in range(STEPS):
        inputs = batch(step) if batches is None else batches
        opt.fused_backward(model(**inputs).loss, schedule(step))
        norms.append(None if opt.last_grad_norm is None else opt.last_grad_norm.item())
    return opt, norms


def assert_same_parameters(a, b):
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)


@pytest.mark.parametrize("call", ["accelerator.backward", "prepared.fused_backward"])
@pytest.mark.parametrize("name", ["lomo", "adalomo"])
def test_accelerate_steps_as_the_plain_loop(call, name):
    reference, model = tiny_llama(), tiny_llama()
    _, norms = manual(reference, CLASSES[name], **OPTIONS)
    accelerator = Accelerator(cpu=True)
    model, opt = accelerator.prepare(model, CLASSES[name](model, lr=LR, **OPTIONS))
    assert isinstance(opt, AcceleratedOptimizer)
    for step in range(STEPS):
        loss = model(**batch(step)).loss
        if call == "accelerator.backward":
            accelerator.backward(loss, learning_rate=schedule(step))
        else:
            opt.fused_backward(loss, schedule(step))
        norm = accelerator.clip_grad_norm_(model.parameters(), OPTIONS["clip_grad_norm"])
        assert norm.item() == norms[step]  # the step's own norm, not 0.0 from freed grads
        opt.step()
        opt.zero_grad()
    assert_same_parameters(model, reference)


def test_accelerate_refuses_what_the_step_cannot_honour():
    model = tiny_llama()
    before = [p.clone() for p in model.parameters()]
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model, opt = accelerator.prepare(model, Lomo(model, lr=LR))
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2.*accumulation_steps=1"):
        accelerator.backward(model(**batch(0)).loss, learning_rate=LR)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))


def accelerate_run(model, optimizer, k=2, micro_batches=6):
    """accelerate's accumulation loop: accumulate(), backward, step and zero_grad per
    micro-batch (the wrapped optimizer steps on sync steps only)."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=k)
    model, opt = accelerator.prepare(model, optimizer)
    lr = {"learning_rate": LR} if isinstance(optimizer, Lomo) else {}  # torch's takes none
    for i in range(micro_batches):
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch(i)).loss, **lr)
            accelerator.clip_grad_norm_(model.parameters(), OPTIONS["clip_grad_norm"])
            opt.step()
            opt.zero_grad()
    return accelerator


def test_accelerate_accumulation_equals_torchs():
    ours, ref = tiny_llama(), tiny_llama()
    accelerate_run(ours, Lomo(ours, lr=LR, clip_grad_norm=1.0, accumulation_steps=2))
    accelerate_run(ref, torch.optim.SGD(ref.parameters(), lr=LR))
    # The suite's bound for Lomo against torch.optim.SGD in fp32 (test_accumulation.py).
    assert max_rel_diff(ours, ref) <= 1e-6


def test_accelerate_save_in_the_middle_of_a_step_leaves_the_micro_batches_out(tmp_path):
    """usage.md: in an accelerate loop, which decides where steps end (accumulate()), a save
    while micro-batches wait (state_dict(), accelerator.save_state()) leaves them out with a
    warning, as torch's checkpoint leaves out .grad, where a plain loop's is refused: the
    checkpoint is the last step's, and the run goes on with them, as torch's does."""
    ours, ref = tiny_llama(), tiny_llama()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=4)
    lomo = Lomo(ours, lr=LR, clip_grad_norm=ACCUMULATED_CLIP, accumulation_steps=4)
    model, opt = accelerator.prepare(ours, lomo)
    for i in range(8):
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch(i)).loss, learning_rate=LR)
            accelerator.clip_grad_norm_(model.parameters(), ACCUMULATED_CLIP)
            opt.step()
            opt.zero_grad()
        if i == 3:  # the first step applied
            at_step = copy.deepcopy(opt.state_dict())
        if i == 5:  # 2 micro-batches of the second step wait
            assert lomo.pending_micro_batches == 2 and lomo.step_count == 1
            waiting = r"leaves out 2 micro-batches accumulated and not applied \(a step is 4\)"
            with pytest.warns(RuntimeWarning, match="state_dict\\(\\) " + waiting):
                mid_step = opt.state_dict()
            with pytest.warns(RuntimeWarning, match=waiting):
                accelerator.save_state(str(tmp_path / "checkpoint"))
            # Saved without them (the last step's state, in the file too), and still pending.
            assert_same_state(mid_step, at_step)
            saved = torch.load(tmp_path / "checkpoint" / "optimizer.bin", weights_only=True)
            assert_same_state(saved, at_step)
            assert lomo.pending_micro_batches == 2 and lomo.step_count == 1
    assert lomo.step_count == 2 and not lomo.pending_micro_batches
    ref_accelerator = Accelerator(cpu=True, gradient_accumulation_steps=4)
    ref_model, sgd = ref_accelerator.prepare(ref, torch.optim.SGD(ref.parameters(), lr=LR))
    norms = []
    for i in range(8):
        with ref_accelerator.accumulate(ref_model):
            ref_accelerator.backward(ref_model(**batch(i)).loss)
            if ref_accelerator.sync_gradients:
                norms.append(ref_accelerator.clip_grad_norm_(ref.parameters(), ACCUMULATED_CLIP))
            sgd.step()
            sgd.zero_grad()
    assert len(norms) == 2 and min(norms) > ACCUMULATED_CLIP / 0.6  # the clip binds
    # The suite's bound for Lomo against torch.optim.SGD in fp32 (test_accumulation.py).
    assert max_rel_diff(ours, ref) <= FP32_BOUND


def trained_by_trainer(tmp_path, trainer_class=Trainer, **overrides):
    model = tiny_llama()
    trainer = trainer_class(
        model=model,
        args=args(tmp_path, max_steps=STEPS, learning_rate=LR, **overrides),
        train_dataset=dataset(),
    )
    trainer.train()
    return model, trainer, logged(trainer)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["", "activation-checkpointing"])
@pytest.mark.parametrize("name", ["lomo", "adalomo"])
def test_trainer_optim_builds_ours_with_clip_and_decay(tmp_path, name, checkpointing):
    """With activation checkpointing, layers recompute their forward inside backward, between
    the hooks that update the layers above: the recomputation must read this step's weights."""
    model, trainer, logged = trained_by_trainer(
        tmp_path, optim=name, activation_checkpointing=checkpointing
    )
    assert model.is_activation_checkpointing == checkpointing
    opt = lomo_kernels.integrations.huggingface.in_backward_optimizer(trainer.optimizer)
    assert type(opt) is CLASSES[name]
    assert opt.clip_grad_norm == 1.0
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]
    reference = tiny_llama()
    _, norms = manual(
        reference,
        CLASSES[name],
        trainer_batch(),
        param_groups=no_decay_on_norms(reference),
        **OPTIONS,
    )
    assert_same_parameters(model, reference)
    assert logged == norms  # the same parameters, bit for bit: the same norms


def test_trainer_max_grad_norm_zero_switches_clipping_off(tmp_path):
    model, trainer, logged = trained_by_trainer(tmp_path, optim="lomo", max_grad_norm=0.0)
    opt = lomo_kernels.integrations.huggingface.in_backward_optimizer(trainer.optimizer)
    assert opt.clip_grad_norm is None and logged == []  # no norm pass: no norm to log
    reference = tiny_llama()
    manual(
        reference,
        Lomo,
        trainer_batch(),
        weight_decay=0.01,
        param_groups=no_decay_on_norms(reference),
    )
    assert_same_parameters(model, reference)


def test_trainer_optim_lomo_matches_lomo_optim(tmp_path):
    # lomo-optim decays every parameter: compared without decay.
    lomo_optim = require("lomo_optim")
    model, _, _ = trained_by_trainer(tmp_path, optim="lomo", weight_decay=0.0)
    reference = tiny_llama()
    opt = lomo_optim.Lomo(reference, lr=LR, clip_grad_norm=1.0)
    for step in range(STEPS):
        loss = reference(**trainer_batch()).loss
        opt.grad_norm(loss)
        opt.fused_backward(loss, schedule(step))
    assert max_rel_diff(model, reference) <= 1e-5


def test_trainer_optim_args_single_backward_and_a_subclass_split(tmp_path):
    class DecayEverything(Trainer):
        def get_decay_parameter_names(self, model):
            return [n for n, _ in model.named_parameters()]

    _, trainer, logged = trained_by_trainer(
        tmp_path, DecayEverything, optim="adalomo", optim_args="single_backward=True"
    )
    opt = lomo_kernels.integrations.huggingface.in_backward_optimizer(trainer.optimizer)
    assert opt.single_backward and len(logged) == STEPS
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01]  # the subclass's split


def test_trainer_with_a_given_optimizer(tmp_path):
    # No learning_rate reaches backward here (optim is not "lomo"): the groups' lr is used.
    model = tiny_llama()
    opt = Lomo(model, lr=LR, **OPTIONS)
    trainer = Trainer(
        model=model,
        args=args(tmp_path, max_steps=STEPS, learning_rate=LR, optim="adamw_torch"),
        train_dataset=dataset(),
        optimizers=(opt, None),
    )
    trainer.train()
    reference = tiny_llama()
    manual(reference, Lomo, trainer_batch(), **OPTIONS)
    assert_same_parameters(model, reference)


@pytest.mark.parametrize(
    "options, match",
    [
        ({"weight_decay": 0.01}, "max_grad_norm=1.0"),
        (OPTIONS | {"weight_decay": 0.0}, "weight_decay 0.0"),
    ],
)
def test_trainer_refuses_a_given_optimizer_that_would_drop_clip_or_decay(tmp_path, options, match):
    model = tiny_llama()
    before = [p.clone() for p in model.parameters()]
    trainer = Trainer(
        model=model,
        args=args(tmp_path, max_steps=STEPS, optim="adamw_torch"),
        train_dataset=dataset(),
        optimizers=(Lomo(model, lr=LR, **options), None),
    )
    with pytest.raises(ValueError, match=match):
        trainer.train()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))


def test_disable_restores_transformers_and_accelerate(tmp_path):
    lomo_kernels.disable_transformers()
    model = tiny_llama()
    accelerator = Accelerator(cpu=True)
    model, opt = accelerator.prepare(model, Lomo(model, lr=LR))
    assert not hasattr(opt, "fused_backward")


class Streamed(torch.utils.data.IterableDataset):
    """`rows` as an IterableDataset: the Trainer knows no length, so it runs max_steps
    steps of k micro-batches and starts a new pass whenever this one ends."""

    def __init__(self, rows):
        self.rows = rows

    def __iter__(self):
        return iter(self.rows)


# (rows, whether streamed, max_steps, whether each pass's end saves, the steps taken)
PASSES = {
    "whole-steps": (16, False, -1, False, 2),
    # 6 micro-batches: a step of 4, then one of 2, applied at the Trainer's sync step.
    "short-last-step": (12, False, -1, False, 2),
    # 10 micro-batches a pass: each pass ends 2 into a step, where the Trainer does not
    # sync; it carries them into the next pass's first step (6 micro-batches), as torch's
    # .grad carries them.
    "iterable-carried": (20, True, 5, False, 5),
    # The same with a checkpoint at each pass's end, while 2 micro-batches wait: saved
    # without them (with a warning), as torch's checkpoint is saved without .grad.
    "iterable-carried-saved": (20, True, 5, True, 5),
}


@pytest.mark.parametrize("trainer_class", ["Trainer", "LomoTrainer"])
@pytest.mark.parametrize("passes", PASSES)
def test_trainer_accumulation_equals_torchs(tmp_path, passes, trainer_class):
    """Trainer(optim="lomo", gradient_accumulation_steps=4) against the same Trainer with
    torch's SGD, micro-batches of 2 rows: the optimizer follows the loop's sync steps. The
    clip binds on every step, those the k-th micro-batch closes in backward and those
    `step()` applies (short or carried), so the in-backward clip coefficient is compared."""
    from lomo_kernels.integrations.hf_trainer import LomoTrainer

    trainer_class = {"Trainer": Trainer, "LomoTrainer": LomoTrainer}[trainer_class]
    rows, streamed, max_steps, saved, steps = PASSES[passes]

    def data():
        return Streamed(distinct_rows(rows)) if streamed else distinct_rows(rows)

    ours, ref = tiny_llama(), tiny_llama()
    common = dict(gradient_accumulation_steps=4, max_steps=max_steps, num_train_epochs=1,
                  learning_rate=LR, max_grad_norm=ACCUMULATED_CLIP,
                  save_strategy="epoch" if saved else "no")  # fmt: skip
    trainer = trainer_class(model=ours, args=args(tmp_path / "lomo", optim="lomo", **common),
                            train_dataset=data())  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    left_out = [w for w in caught if "leaves out 2 micro-batches" in str(w.message)]
    assert len(left_out) == (2 if saved else 0)  # the two passes that ended mid-step
    reference = Trainer(model=ref, args=args(tmp_path / "sgd", optim="sgd", **common),
                        train_dataset=data())  # fmt: skip
    reference.train()
    opt = lomo_kernels.integrations.huggingface.in_backward_optimizer(trainer.optimizer)
    assert opt.accumulation_steps == 4 and opt.step_count == steps
    assert opt.pending_micro_batches == 0
    # Every step's norm before clipping (torch's, logged by the reference) exceeds the
    # threshold: each step was clipped, by a coefficient of at most 0.6 (max_grad_norm=1.0
    # would leave the k-th-closed steps, whose norms are 0.92-0.95 here, unclipped).
    assert len(logged(reference)) == steps
    assert min(logged(reference)) > ACCUMULATED_CLIP / 0.6
    # The suite's bound for Lomo against torch.optim.SGD in fp32 (test_accumulation.py).
    assert max_rel_diff(ours, ref) <= FP32_BOUND
    assert logged(trainer) == pytest.approx(logged(reference), rel=FP32_BOUND)


class MicroBatchRecorder(RecordsMicroBatches, Trainer):
    """transformers' Trainer recording each micro-batch its training step takes."""


def test_trainer_adalomo_accumulation_equals_its_big_batch_step(tmp_path):
    """Trainer(optim="adalomo", gradient_accumulation_steps=4) on 10 micro-batches of 2 rows
    (steps of 4, 4 and a short one of 2, applied by the Trainer's sync step) against AdaLomo
    without accumulation stepping on each step's concatenated micro-batches in a plain loop:
    the factored second moment, the clip (binding on every step) and the decay split act
    on the accumulated gradient as on the big batch's."""
    ours, ref = tiny_llama(), tiny_llama()
    common = dict(gradient_accumulation_steps=4, max_steps=-1, num_train_epochs=1,
                  learning_rate=LR, max_grad_norm=ACCUMULATED_CLIP)  # fmt: skip
    trainer = MicroBatchRecorder(model=ours, args=args(tmp_path, optim="adalomo", **common),
                           train_dataset=distinct_rows(20))  # fmt: skip
    trainer.train()
    opt = lomo_kernels.integrations.huggingface.in_backward_optimizer(trainer.optimizer)
    assert type(opt) is AdaLomo and opt.accumulation_steps == 4
    assert opt.step_count == STEPS and not opt.pending_micro_batches
    bigs = big_batches(trainer.micro_batches)
    assert [len(big["input_ids"]) for big in bigs] == [8, 8, 4]
    big = AdaLomo(ref, lr=LR, clip_grad_norm=ACCUMULATED_CLIP, weight_decay=0.01,
                  param_groups=no_decay_on_norms(ref))  # fmt: skip
    norms = []
    for step, inputs in enumerate(bigs):  # the Trainer's linear schedule over its 3 steps
        big.fused_backward(ref(**inputs).loss, schedule(step))
        norms.append(float(big.last_grad_norm))
    # The clip binds on every step (a coefficient of at most 0.6): the k-th-closed ones and
    # the short one.
    assert min(norms) > ACCUMULATED_CLIP / 0.6
    # The big batch's gradient is the same sum of the same per-token terms in another order
    # (fp32 rounding), and AdaLomo's update is normalised by its RMS: a rounding-level
    # relative change, the suite's fp32 bound (test_accumulation.py's big-batch test).
    assert max_rel_diff(ours, ref) <= FP32_BOUND
    assert logged(trainer) == pytest.approx(norms, rel=FP32_BOUND)
    assert max_rel_diff(ours, tiny_llama()) > 1e4 * FP32_BOUND  # the steps moved the model


@pytest.mark.parametrize(
    "model_dtype, text, buffer",
    [
        (torch.float32, "float32", torch.float32),
        (torch.bfloat16, "fp32", torch.float32),
        (torch.float32, "bf16", torch.bfloat16),
        (torch.float32, "int8", torch.int8),
    ],
    ids=["fp32-weights-float32", "bf16-weights-fp32", "fp32-weights-bf16", "fp32-weights-int8"],
)
def test_trainer_optim_args_accumulation_dtype(tmp_path, model_dtype, text, buffer):
    """Trainer(optim="lomo", optim_args="accumulation_dtype=...") through
    enable_transformers() builds the optimizer with that buffer, and the run is that of the
    same Lomo with that buffer in a plain loop on the recorded micro-batches (12 rows: a
    step of 4 micro-batches and a short one of 2), bit for bit: the same ops on the same
    values with the same rounding bits. The parameter's own buffer dtype gives other bits
    (so the comparison tells the buffers apart); with fp32 weights and an fp32 buffer the run
    is compared with the same Trainer and torch's SGD instead."""
    ours, own = tiny_llama(model_dtype), tiny_llama(model_dtype)
    common = dict(gradient_accumulation_steps=4, max_steps=-1, num_train_epochs=1,
                  learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0,
                  max_grad_norm=ACCUMULATED_CLIP)  # fmt: skip
    trainer = MicroBatchRecorder(
        model=ours,
        args=args(tmp_path / "ours", optim_args=f"accumulation_dtype={text}", **common),
        train_dataset=distinct_rows(12),
    )
    trainer.train()
    opt = lomo_kernels.integrations.huggingface.in_backward_optimizer(trainer.optimizer)
    assert type(opt) is Lomo and opt.accumulation_dtype == buffer
    assert opt.step_count == 2 and not opt.pending_micro_batches
    assert max_rel_diff(ours, tiny_llama(model_dtype)) > 1e4 * FP32_BOUND  # the steps moved it
    options = dict(lr=LR, clip_grad_norm=ACCUMULATED_CLIP, accumulation_steps=4)
    own_opt = Lomo(own, accumulation_dtype=buffer, **options)
    replay(own, own_opt, trainer.micro_batches)
    assert own_opt.step_count == 2
    assert max_rel_diff(ours, own) == 0.0
    if buffer == model_dtype:  # the default buffer: compared with torch's accumulation
        ref = tiny_llama()
        reference = Trainer(model=ref, args=args(tmp_path / "sgd", optim="sgd", **common),
                            train_dataset=distinct_rows(12))  # fmt: skip
        reference.train()
        assert min(logged(reference)) > ACCUMULATED_CLIP / 0.6  # the clip binds on each step
        # The suite's bound for Lomo against torch.optim.SGD in fp32 (test_accumulation.py).
        assert max_rel_diff(ours, ref) <= FP32_BOUND
    else:
        other = tiny_llama(model_dtype)
        replay(other, Lomo(other, **options), trainer.micro_batches)
        assert max_rel_diff(ours, other) > 0.0


def test_trainer_refuses_a_loop_that_never_syncs(tmp_path):
    """An IterableDataset of 3 micro-batches a pass, 4 a step: the Trainer never reaches its
    sync step (torch's SGD would train on without a step). Refused once 7 micro-batches
    wait unsynced, more than any step the Trainer carries, before that one's backward."""
    ours = tiny_llama()
    common = dict(gradient_accumulation_steps=4, max_steps=2, learning_rate=LR)
    trainer = Trainer(model=ours, args=args(tmp_path, optim="lomo", **common),
                      train_dataset=Streamed(distinct_rows(6)))  # fmt: skip
    before = [p.detach().clone() for p in ours.parameters()]
    with pytest.raises(ValueError, match="has not synced gradients for 7 micro-batches"):
        trainer.train()
    opt = lomo_kernels.integrations.huggingface.in_backward_optimizer(trainer.optimizer)
    assert opt.pending_micro_batches == 6 and opt.step_count == 0
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), before, strict=True))


def test_trainer_optim_lomo_keeps_a_given_optimizers_group_lrs(tmp_path):
    """Trainer(optim="lomo") passes its scheduler's lr of the first group to backward; a
    given optimizer's groups keep each their own (here the head's 10x smaller), as the same
    Trainer with torch's SGD on those groups does."""

    def groups(model):
        head = [p for n, p in model.named_parameters() if n.startswith("lm_head")]
        rest = [p for n, p in model.named_parameters() if not n.startswith("lm_head")]
        return [{"params": rest, "lr": LR}, {"params": head, "lr": LR / 10}]

    ours, ref = tiny_llama(), tiny_llama()
    common = dict(gradient_accumulation_steps=2, max_steps=-1, num_train_epochs=1,
                  learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0,
                  max_grad_norm=0.0)  # fmt: skip
    opt = Lomo(groups(ours), lr=LR, accumulation_steps=2)
    Trainer(model=ours, args=args(tmp_path / "lomo", optim="lomo", **common),
            train_dataset=distinct_rows(8), optimizers=(opt, None)).train()  # fmt: skip
    sgd = torch.optim.SGD(groups(ref), lr=LR)
    Trainer(model=ref, args=args(tmp_path / "sgd", optim="sgd", **common),
            train_dataset=distinct_rows(8), optimizers=(sgd, None)).train()  # fmt: skip
    assert [g["lr"] for g in opt.param_groups] == [LR, LR / 10] and opt.step_count == 2
    assert max_rel_diff(ours, ref) <= 1e-6  # the suite's bound against torch's SGD in fp32


@pytest.mark.parametrize("trainer_class", ["Trainer", "LomoTrainer"])
def test_trainer_run_after_an_interrupted_one_drops_its_micro_batches(tmp_path, trainer_class):
    """A train() interrupted in the middle of a step leaves micro-batches pending; the next
    train() of the same Trainer drops them (with a warning), as the Trainer's
    model.zero_grad() drops torch's accumulated .grad, so it equals a run never
    interrupted."""
    from transformers import TrainerCallback

    from lomo_kernels.integrations.hf_trainer import LomoTrainer

    trainer_class = {"Trainer": Trainer, "LomoTrainer": LomoTrainer}[trainer_class]

    class Interrupt(TrainerCallback):
        armed = True

        def on_substep_end(self, *args, **kwargs):
            if self.armed:
                self.armed = False
                raise KeyboardInterrupt("interrupted after the step's first micro-batch")

    common = dict(gradient_accumulation_steps=3, max_steps=-1, num_train_epochs=1,
                  learning_rate=LR)  # fmt: skip
    ours, clean = tiny_llama(), tiny_llama()
    trainer = trainer_class(model=ours, args=args(tmp_path / "ours", **common),
                            train_dataset=distinct_rows(12), callbacks=[Interrupt()])  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    opt = lomo_kernels.integrations.huggingface.in_backward_optimizer(trainer.optimizer)
    assert opt.pending_micro_batches == 1
    with pytest.warns(RuntimeWarning, match=r"dropped 1 micro-batch .* \(a step is 3\)"):
        trainer.train()
    trainer_class(model=clean, args=args(tmp_path / "clean", **common),
                  train_dataset=distinct_rows(12)).train()  # fmt: skip
    assert opt.step_count == 2 and not opt.pending_micro_batches
    assert max_rel_diff(ours, clean) == 0.0


def test_a_plain_backward_is_refused_in_the_callers_terms():
    """loss.backward() with a Lomo attached: with enable_transformers() active the message
    says so (the backward came from elsewhere); without, it says to call it."""
    model = tiny_llama()
    opt = Lomo(model, lr=LR)
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError) as refused:
        model(**batch(0)).loss.backward()
    assert "enable_transformers() is active" in str(refused.value)
    assert "call lomo_kernels.enable_transformers() first" not in str(refused.value)
    lomo_kernels.disable_transformers()
    with pytest.raises(RuntimeError, match="call lomo_kernels.enable_transformers\\(\\) first"):
        model(**batch(0)).loss.backward()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))
    opt.detach()


def test_enable_transformers_needs_no_lomo_optim(tmp_path, monkeypatch):
    """lomo-optim absent (not importable, its metadata not found): optim="lomo" trains with
    ours, and the fp16 autocast refusal names bf16, which trains."""
    import accelerate.accelerator
    import transformers.trainer_optimizer

    monkeypatch.setitem(sys.modules, "lomo_optim", None)
    monkeypatch.setattr(accelerate.accelerator, "is_lomo_available", lambda: False)
    monkeypatch.setattr(transformers.trainer_optimizer, "is_lomo_available", lambda: False)
    model, trainer, logged = trained_by_trainer(tmp_path, optim="lomo")
    opt = lomo_kernels.integrations.huggingface.in_backward_optimizer(trainer.optimizer)
    assert type(opt) is Lomo and len(logged) == STEPS
    with pytest.raises(ValueError, match="fp16 autocast.*or use bf16"):
        trained_by_trainer(tmp_path, optim="lomo", fp16=True)
    _, _, logged = trained_by_trainer(tmp_path, optim="adalomo", bf16=True)
    assert len(logged) == STEPS
