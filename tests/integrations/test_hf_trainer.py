"""LomoTrainer: transformers.Trainer training with lomo_kernels' optimizers."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from support.accumulating import FP32_BOUND
from support.dependencies import require
from support.float64 import FP32_NORM_RTOL
from support.hf_trainer import (
    RecordsMicroBatches,
    args,
    assert_skipped_steps_hold_the_warmup,
    big_batches,
    dataset,
    distinct_rows,
    logged,
    no_decay_on_norms,
    norm_weight_names,
    replay,
    trainer_batch,
)
from support.models import max_rel_diff, tiny_llama

transformers = require("transformers")
from transformers import Trainer  # noqa: E402

import lomo_kernels  # noqa: E402
from lomo_kernels import Lomo  # noqa: E402
from lomo_kernels.integrations.hf_trainer import LomoTrainer  # noqa: E402
from lomo_kernels.integrations.huggingface import in_backward_optimizer  # noqa: E402

# The accumulation test's max_grad_norm: below each step's norm before clipping (asserted),
# so the clip binds on every step (at max_grad_norm=1.0 it would not on the 4th micro-batch's).
ACCUMULATED_CLIP = 0.4


class RecordingTrainer(RecordsMicroBatches, LomoTrainer):
    """Records the learning rate the optimizer holds at each step and each micro-batch."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.seen_lrs = getattr(self, "seen_lrs", [])
        self.seen_lrs.append(self._lomo().param_groups[0]["lr"])
        return super().training_step(model, inputs, num_items_in_batch)


@pytest.mark.parametrize("optim", ["lomo", "adalomo"])
def test_trainer_trains_with_schedule_clip_and_decay(tmp_path, optim):
    """12 steps of LomoTrainer (linear schedule, clip by norm 1.0, weight decay 0.01 but on the
    norm weights) against the same optimizer's own loop on the same batches at the same lrs:
    the same ops on the same values, so within the suite's fp32 bound, with the clip binding
    on some steps and the decay moving the parameters by more than that bound."""
    model, own = tiny_llama(), tiny_llama()
    lr = 0.3 if optim == "lomo" else 0.05
    trainer = RecordingTrainer(
        model=model, args=args(tmp_path, optim=optim, learning_rate=lr), train_dataset=dataset()
    )
    trainer.train()
    opt = trainer._lomo()
    assert type(opt).__name__ == {"lomo": "Lomo", "adalomo": "AdaLomo"}[optim]
    assert opt.clip_grad_norm == 1.0
    # Linear decay from lr to 0 over 12 steps: the optimizer used the scheduler's value.
    expected = [lr * (1 - k / 12) for k in range(12)]
    assert trainer.seen_lrs == pytest.approx(expected)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < losses[0] - 0.5

    def replay(decay: float, clip: float | None) -> tuple[torch.nn.Module, list[float]]:
        replayed = tiny_llama()
        own_opt = type(opt)(replayed, lr=lr, clip_grad_norm=clip, weight_decay=decay,
                            param_groups=no_decay_on_norms(replayed))  # fmt: skip
        seen = []
        for step_lr, (_, inputs, num_items) in zip(trainer.seen_lrs, trainer.micro_batches,
                                                   strict=True):  # fmt: skip
            own_opt.fused_backward(replayed(**inputs, num_items_in_batch=num_items).loss, step_lr)
            seen.append(float(own_opt.last_grad_norm or 0.0))
        return replayed, seen

    own, own_norms = replay(0.01, 1.0)
    assert max_rel_diff(model, own) <= FP32_BOUND
    assert logged(trainer) == pytest.approx(own_norms, rel=FP32_BOUND)
    assert max(own_norms) > 1.0  # the clip binds
    # Without the decay, or without the clip, the same loop ends elsewhere: farther than the
    # bound above by a margin (AdaLomo's decay: 7e-5 here).
    assert max_rel_diff(replay(0.0, 1.0)[0], own) > 10 * FP32_BOUND
    assert max_rel_diff(replay(0.01, None)[0], own) > 10 * FP32_BOUND


class MicroBatchRecorder(RecordsMicroBatches, LomoTrainer):
    """Records each micro-batch the training step takes, each loss scaled as a share of the
    step's (the model divides the summed loss by the step's item count)."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        assert self._loss_scaled_for_accumulation(num_items_in_batch)
        return super().training_step(model, inputs, num_items_in_batch)


@pytest.mark.parametrize("optim", ["lomo", "adalomo"])
def test_trainer_accumulates_micro_batches(tmp_path, optim):
    """LomoTrainer with gradient_accumulation_steps=4 against the optimizer's own loop on the
    same micro-batches, and against transformers' Trainer with torch's SGD (Lomo) or
    AdaLomo's step on each step's micro-batches concatenated (AdaLomo); 12 rows end the
    epoch with a short step of 2 micro-batches."""
    ours, own, ref = tiny_llama(), tiny_llama(), tiny_llama()
    lr = 0.2 if optim == "lomo" else 0.01
    common = dict(gradient_accumulation_steps=4, max_steps=-1, num_train_epochs=1,
                  learning_rate=lr, lr_scheduler_type="constant", weight_decay=0.0,
                  max_grad_norm=ACCUMULATED_CLIP, seed=0)  # fmt: skip
    trainer = MicroBatchRecorder(model=ours, args=args(tmp_path / "ours", optim=optim, **common),
                                 train_dataset=distinct_rows(12))  # fmt: skip
    trainer.train()
    opt = trainer._lomo()
    assert opt.accumulation_steps == 4 and opt.step_count == 2 and not opt.pending_micro_batches
    assert len(trainer.micro_batches) == 6
    # The same optimizer (max_grad_norm as clip_grad_norm) in a plain loop: the same ops
    # on the same values, so within the suite's fp32 bound (test_accumulation.py).
    own_opt = type(opt)(own, lr=lr, clip_grad_norm=ACCUMULATED_CLIP, weight_decay=0.0,
                        accumulation_steps=4)  # fmt: skip
    own_norms = replay(own, own_opt, trainer.micro_batches)
    assert own_opt.step_count == 2
    # The clip binds on both steps, the one the 4th micro-batch closes in backward and the
    # short one step() applies (norms 0.95 and 1.3 here), each by a coefficient of at most 0.6.
    assert min(own_norms) > ACCUMULATED_CLIP / 0.6
    assert max_rel_diff(ours, own) <= FP32_BOUND
    assert logged(trainer) == pytest.approx(own_norms, rel=FP32_BOUND)
    assert max_rel_diff(ours, tiny_llama()) > 100 * FP32_BOUND  # the steps moved the model
    if optim == "lomo":
        reference = Trainer(model=ref, args=args(tmp_path / "sgd", optim="sgd", **common),
                            train_dataset=distinct_rows(12))  # fmt: skip
        reference.train()
        assert logged(trainer) == pytest.approx(logged(reference), rel=FP32_BOUND)
        # The suite's bound for Lomo against torch.optim.SGD in fp32 (test_accumulation.py).
        assert max_rel_diff(ours, ref) <= FP32_BOUND
    else:
        # AdaLomo without accumulation on each step's micro-batches concatenated (rows of one
        # length: the big batch's mean loss is the sum of the micro-batches' losses, each
        # divided by the step's item count): the same gradient summed in another order, and
        # an update normalised by its RMS, so within the same fp32 bound
        # (test_accumulation.py's big-batch test).
        bigs = big_batches(trainer.micro_batches)
        big = type(opt)(ref, lr=lr, clip_grad_norm=ACCUMULATED_CLIP, weight_decay=0.0)
        big_norms = []
        for inputs in bigs:
            big.fused_backward(ref(**inputs).loss)
            big_norms.append(float(big.last_grad_norm))
        assert [len(inputs["input_ids"]) for inputs in bigs] == [8, 4]  # 4 and 2 micro-batches
        assert logged(trainer) == pytest.approx(big_norms, rel=FP32_BOUND)
        assert max_rel_diff(ours, ref) <= FP32_BOUND


def test_trainer_accumulates_into_the_8_bit_buffer_from_optim_args(tmp_path):
    # optim_args="accumulation_dtype=int8": the optimizer's buffers are 8-bit (one byte per
    # element and a scale per 256) and the run takes its steps, the epoch's short one too.
    model = tiny_llama()
    trainer = LomoTrainer(
        model=model,
        args=args(tmp_path, gradient_accumulation_steps=4, max_steps=-1, num_train_epochs=1,
                  learning_rate=0.2, optim_args="accumulation_dtype=int8"),
        train_dataset=distinct_rows(12),
    )  # fmt: skip
    before = [p.clone() for p in model.parameters()]
    trainer.train()
    opt = trainer._lomo()
    assert opt.accumulation_dtype == torch.int8 and opt.step_count == 2
    numel = sum(p.numel() for p in model.parameters())
    assert numel <= opt._accumulation.buffer_bytes() < 1.05 * numel
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))


def test_trainer_refuses_a_given_optimizer_counting_other_micro_batches(tmp_path):
    model = tiny_llama()
    with pytest.raises(ValueError, match="gradient_accumulation_steps=4.*accumulation_steps=1"):
        LomoTrainer(
            model=model,
            args=args(tmp_path, gradient_accumulation_steps=4),
            train_dataset=dataset(),
            optimizers=(Lomo(model, lr=0.1), None),
        )


def test_trainer_uses_a_given_optimizer(tmp_path):
    model = tiny_llama()
    opt = Lomo(model, lr=0.2, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    trainer = LomoTrainer(
        model=model,
        args=args(tmp_path, max_steps=3),
        train_dataset=dataset(),
        optimizers=(opt, sched),
    )
    trainer.train()
    assert trainer._lomo() is opt and opt.step_count == 3


def test_plain_trainer_with_lomo_explains_what_to_use(tmp_path):
    model = tiny_llama()
    opt = Lomo(model, lr=0.2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    trainer = Trainer(
        model=model,
        args=args(tmp_path, max_steps=2, optim="adamw_torch"),
        train_dataset=dataset(),
        optimizers=(opt, sched),
    )
    with pytest.raises(RuntimeError, match="LomoTrainer"):
        trainer.train()


def fields_of(targs) -> dict:
    return {f.name: copy.deepcopy(getattr(targs, f.name)) for f in dataclasses.fields(targs)}


@pytest.mark.parametrize("positional", [False, True], ids=["args=", "positional"])
def test_trainer_leaves_the_callers_arguments_unchanged(tmp_path, positional):
    targs = args(tmp_path, max_steps=2)
    before = fields_of(targs)
    trainers = []
    for _ in range(2):  # the second trainer is built from the arguments the first one saw
        call = (
            ((tiny_llama(), targs), {})
            if positional
            else ((), {"model": tiny_llama(), "args": targs})
        )
        trainer = LomoTrainer(*call[0], **call[1], train_dataset=dataset())
        trainer.train()
        trainers.append(trainer)
    assert fields_of(targs) == before
    assert targs.max_grad_norm == 1.0
    for trainer in trainers:
        assert trainer.args is not targs and trainer.args.max_grad_norm == 0.0
        assert trainer._lomo().clip_grad_norm == 1.0
    first, second = ([h["loss"] for h in t.state.log_history if "loss" in h] for t in trainers)
    assert first == second  # same model, data and clipping: the same steps


def sgd_with_transformers_split(model, steps, lr, weight_decay, max_norm):
    """torch.optim.SGD with Trainer's groups (no decay on the RMSNorm weights: a LLaMA has
    no bias), the linear schedule and clip_grad_norm_; returns the pre-clip norms."""
    no_decay = norm_weight_names(model)
    named = list(model.named_parameters())
    sgd = torch.optim.SGD(
        [
            {"params": [p for n, p in named if n not in no_decay]},
            {"params": [p for n, p in named if n in no_decay], "weight_decay": 0.0},
        ],
        lr=lr,
        weight_decay=weight_decay,
    )
    norms = []
    for step in range(steps):
        for group in sgd.param_groups:
            group["lr"] = lr * (1 - step / steps)
        sgd.zero_grad()
        model(**trainer_batch()).loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        sgd.step()
    return norms


def test_trainer_decays_as_transformers_and_logs_the_pre_clip_norm(tmp_path):
    model, ref = tiny_llama(), tiny_llama()
    trainer = LomoTrainer(
        model=model,
        args=args(tmp_path, max_steps=3, learning_rate=0.2, weight_decay=0.3, max_grad_norm=0.5),
        train_dataset=dataset(),
    )
    trainer.train()
    decay, no_decay = trainer._lomo().param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in no_decay["params"]} == norm_weight_names(model)
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.3, 0.0)
    norms = sgd_with_transformers_split(ref, 3, lr=0.2, weight_decay=0.3, max_norm=0.5)
    # As the one-group comparison with SGD (test_lomo_optimizer.py): fp32 sums in another
    # order. Decaying the norm weights too would be off by about lr * 0.3 = 6e-2.
    assert max_rel_diff(model, ref) <= 1e-6
    assert min(norms) > 0.5  # every step clipped
    assert logged(trainer) == pytest.approx(norms, rel=FP32_NORM_RTOL)


def test_trainer_leaves_frozen_parameters_out(tmp_path):
    """A frozen embedding (requires_grad False) is in neither of Trainer's groups and keeps
    its values; the rest trains as torch's SGD with the same groups, clip and schedule."""
    model, ref = tiny_llama(), tiny_llama()
    for m in (model, ref):
        m.get_input_embeddings().weight.requires_grad_(False)
    frozen = model.get_input_embeddings().weight.detach().clone()
    trainer = LomoTrainer(
        model=model,
        args=args(tmp_path, max_steps=3, learning_rate=0.2, weight_decay=0.3, max_grad_norm=0.5),
        train_dataset=dataset(),
    )
    trainer.train()
    grouped = [p for group in trainer._lomo().param_groups for p in group["params"]]
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(grouped) == len(trainable) and {id(p) for p in grouped} == set(map(id, trainable))
    assert torch.equal(model.get_input_embeddings().weight, frozen)
    sgd_with_transformers_split(ref, 3, lr=0.2, weight_decay=0.3, max_norm=0.5)
    assert max_rel_diff(model, ref) <= 1e-6  # as the test above


def count_backwards(monkeypatch):
    calls = []
    original = torch.Tensor.backward

    def backward(self, *a, **k):
        calls.append(1)
        return original(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "backward", backward)
    return calls


@pytest.mark.parametrize(
    "optim_args, per_step", [(None, 2), ("single_backward=False", 2), ("single_backward=True", 1)]
)
def test_trainer_clipping_mode_from_optim_args(tmp_path, monkeypatch, optim_args, per_step):
    """Exact clipping by default and with single_backward=False (a norm pass: two backward
    passes), one backward with single_backward=True; both log the step's norm before
    clipping."""
    model = tiny_llama()
    trainer = LomoTrainer(
        model=model,
        args=args(
            tmp_path, max_steps=3, learning_rate=0.2, max_grad_norm=0.5, optim_args=optim_args
        ),
        train_dataset=dataset(),
    )
    calls = count_backwards(monkeypatch)
    trainer.train()
    assert trainer._lomo().single_backward == (per_step == 1)
    assert len(calls) == 3 * per_step
    # The first step starts from the same weights in both modes: the same norm.
    first = sgd_with_transformers_split(tiny_llama(), 1, lr=0.2, weight_decay=0.01, max_norm=0.5)
    norms = logged(trainer)
    assert len(norms) == 3 and norms[0] == pytest.approx(first[0], rel=FP32_NORM_RTOL)


def test_trainer_logs_no_grad_norm_when_the_step_measures_none(tmp_path):
    trainer = LomoTrainer(
        model=tiny_llama(),
        args=args(tmp_path, max_steps=2, max_grad_norm=0.0),
        train_dataset=dataset(),
    )
    trainer.train()
    assert logged(trainer) == [] and len(logged(trainer, "loss")) == 2  # not 0.0


@pytest.mark.parametrize(
    "optim_args, match",
    [
        ("momentum=0.9", "accepted: accumulation_dtype, single_backward"),
        ("single_backward=maybe", "True or False"),
        ("accumulation_dtype=int4", "one of int8"),
    ],
)
def test_trainer_refuses_optim_args_it_cannot_honour(tmp_path, optim_args, match):
    model = tiny_llama()
    before = [p.clone() for p in model.parameters()]
    trainer = LomoTrainer(
        model=model,
        args=args(tmp_path, max_steps=2, optim_args=optim_args),
        train_dataset=dataset(),
    )
    with pytest.raises(ValueError, match=match):
        trainer.train()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))


class SkipRecorder(transformers.TrainerCallback):
    """Per optimizer step: the lr the step ran with and whether the optimizer skipped it."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, bool]] = []

    def on_optimizer_step(self, targs, state, control, optimizer=None, **kwargs):
        lomo = in_backward_optimizer(optimizer)
        lomo.flush_report()  # the step's outcome now, not at the next call
        self.steps.append((lomo.param_groups[0]["lr"], lomo.last_step_skipped))


@pytest.mark.parametrize("trainer_kind", ["LomoTrainer", "Trainer"])
def test_fp16_steps_skipped_for_overflow_hold_the_lr_schedule(tmp_path, trainer_kind):
    """As with torch's GradScaler, a step the fp16 dynamic loss scaler skips (its scale starts
    too high, so the first steps overflow) does not advance the Trainer's lr schedule: each
    step runs at the schedule's lr for the steps applied before it (transformers' own linear
    warm-up schedule, evaluated here independently of the run)."""
    lr, warmup, steps = 0.1, 4, 8
    model = tiny_llama(torch.float16)
    opt = Lomo(
        model, lr=lr, clip_grad_norm=1.0, accumulation_steps=2,
        loss_scale_args={"init_scale": 2.0**21},
    )  # fmt: skip
    recorder = SkipRecorder()
    targs = args(
        tmp_path, max_steps=steps, learning_rate=lr, warmup_steps=warmup, weight_decay=0.0,
        gradient_accumulation_steps=2,
    )  # fmt: skip
    kwargs = dict(args=targs, train_dataset=distinct_rows(32), optimizers=(opt, None))
    if trainer_kind == "Trainer":
        lomo_kernels.enable_transformers()
        trainer = Trainer(model=model, callbacks=[recorder], **kwargs)
    else:
        trainer = LomoTrainer(model=model, callbacks=[recorder], **kwargs)
    try:
        trainer.train()
    finally:
        lomo_kernels.disable_transformers()
    assert len(recorder.steps) == steps
    assert_skipped_steps_hold_the_warmup(recorder.steps, lr, warmup)
