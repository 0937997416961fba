"""TRL's SFTTrainer with Lomo/AdaLomo and the logits-free head (`enable_trl`,
`patch_causal_lm` before or after the trainer is built), against the same runs unpatched
(TRL's own chunked head); and the refusal when TRL's head wraps a patched model."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import pytest
import torch
from support.allocations import LargestMatrix, formed_gradients
from support.dependencies import require
from support.float64 import FP32_NORM_RTOL
from support.models import assert_steps_match, causal_lm, max_rel_diff
from support.state import assert_unchanged_since, optimizer_snapshot

import lomo_kernels
from lomo_kernels.integrations import causal_lm as patched_head

try:  # a test dependency (`make setup`): a test here fails without it (the `trl` fixture),
    # but the module still collects on a GPU box running only `-m cuda` tests
    import datasets
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    from lomo_kernels.integrations.huggingface import in_backward_optimizer

    datasets.disable_progress_bars()
except ImportError:
    SFTTrainer = None


@pytest.fixture(autouse=True)
def trl():
    return require("trl")


VOCAB = 96
STEPS = 3
# The patched head's fused losses (`causal_lm._head_forward` calls them by these names).
FUSED_LOSSES = ("causal_lm_loss", "linear_cross_entropy")
# The fused loss's bound against transformers' unfused loss (test_causal_lm_patch): 64 u.
LOSS_RTOL = 64 * 2.0**-24


def tokenizer(vocab: int = VOCAB):
    words = ["<pad>", "<eos>"] + [f"t{i}" for i in range(2, vocab)]
    model = models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="t2")
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def dataset(vocab: int = VOCAB, n: int = 8):
    """Tokenized prompt + completion rows of uneven length: a 3-token prompt TRL leaves out of
    the loss (its completion-only mask), padded or packed by the trainer."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for i in range(n):
        ids = torch.randint(2, vocab, (6 + i % 5,), generator=gen).tolist() + [1]
        rows.append({"input_ids": ids, "completion_mask": [0] * 3 + [1] * (len(ids) - 3)})
    return datasets.Dataset.from_list(rows)


# A quiet fp32 CPU run, logging every step (shared by test_trl_preference).
CPU_RUN = dict(
    bf16=False,  # TRL's default is bf16 autocast; the comparisons run in fp32
    report_to=[],
    logging_steps=1,
    save_strategy="no",
    use_cpu=True,
    disable_tqdm=True,
    dataloader_num_workers=0,
    seed=0,
)


def config(tmp_path, **overrides):
    base = dict(
        **CPU_RUN,
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=STEPS,
        learning_rate=0.05,
        lr_scheduler_type="linear",
        optim="lomo",
        max_grad_norm=1.0,
        weight_decay=0.01,
        completion_only_loss=True,
        max_length=32,
        shuffle_dataset=False,
    )
    base.update(overrides)
    return SFTConfig(**base)


def logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h and "train_runtime" not in h]


def llama(vocab: int = VOCAB) -> torch.nn.Module:
    """support.models.tiny_llama's shape with `vocab` words."""
    return causal_lm(vocab_size=vocab)


def trained(tmp_path, patch=None, vocab=VOCAB, trainer_class=None, **overrides):
    """(model, trainer) after STEPS steps; `patch`: None, "before" (with enable_trl) or
    "after" (patch_causal_lm on the built trainer's model, enable_transformers only)."""
    model = llama(vocab)
    if patch == "before":
        lomo_kernels.patch_causal_lm(model)
        lomo_kernels.enable_trl()
    else:
        lomo_kernels.enable_transformers()
    try:
        trainer = (trainer_class or SFTTrainer)(
            model=model,
            args=config(tmp_path, **overrides),
            train_dataset=dataset(vocab),
            processing_class=tokenizer(vocab),
        )
        if patch == "after":
            lomo_kernels.patch_causal_lm(trainer.model)
        # Every gradient autograd computes for the head's weight (none where Lomo steps it
        # from the fused loss's vocabulary chunks).
        trainer.head_gradients = formed_gradients(model.lm_head.weight)
        with counting_fused_losses() as trainer.fused_losses:
            trainer.train()
    finally:
        lomo_kernels.disable_trl()
    return model, trainer


@contextlib.contextmanager
def counting_fused_losses() -> Iterator[list[str]]:
    """The fused losses the patched head computes (its two entry points), by name."""
    calls: list[str] = []
    saved = {name: getattr(patched_head, name) for name in FUSED_LOSSES}
    for name, function in saved.items():

        def counted(*args, _name=name, _function=function, **kwargs):
            calls.append(_name)
            return _function(*args, **kwargs)

        setattr(patched_head, name, counted)
    try:
        yield calls
    finally:
        for name, function in saved.items():
            setattr(patched_head, name, function)


_UNPATCHED: dict[tuple[str, bool], tuple[torch.nn.Module, object]] = {}


def unpatched(tmp_path_factory, optim, packing):
    """The same run with TRL's own head (once per module)."""
    key = (optim, packing)
    if key not in _UNPATCHED:
        _UNPATCHED[key] = trained(tmp_path_factory.mktemp("plain"), optim=optim, packing=packing)
    return _UNPATCHED[key]


@pytest.mark.parametrize(
    "optim,packing,patch",
    [
        ("lomo", False, "after"),
        ("lomo", True, "before"),
        ("adalomo", False, "before"),
        ("adalomo", True, "after"),
    ],
    ids=[
        "lomo-padded-after",
        "lomo-packed-before",
        "adalomo-padded-before",
        "adalomo-packed-after",
    ],
)
def test_sft_trainer_with_the_fused_head_matches_trls_own(tmp_path_factory, optim, packing, patch):
    """3 steps (completion-only loss, clipping, weight decay, linear schedule): each step's
    loss within the fused loss's bound of the unpatched run's (64 u), its grad norm within
    64 u, the parameters within 4 ulps or 1e-4 of the largest update; TRL's entropy and token
    accuracy from the fused head within 1e-5 and equal."""
    plain_model, plain = unpatched(tmp_path_factory, optim, packing)
    model, trainer = trained(
        tmp_path_factory.mktemp("fused"), patch=patch, optim=optim, packing=packing
    )
    assert (
        type(in_backward_optimizer(trainer.optimizer)).__name__
        == {
            "lomo": "Lomo",
            "adalomo": "AdaLomo",
        }[optim]
    )
    losses, plain_losses = logged(trainer, "loss"), logged(plain, "loss")
    assert len(losses) == STEPS
    assert losses == pytest.approx(plain_losses, rel=LOSS_RTOL, abs=0)
    assert logged(trainer, "grad_norm") == pytest.approx(
        logged(plain, "grad_norm"), rel=FP32_NORM_RTOL, abs=0
    )
    assert logged(trainer, "entropy") == pytest.approx(logged(plain, "entropy"), abs=1e-5)
    assert logged(trainer, "mean_token_accuracy") == logged(plain, "mean_token_accuracy")
    assert_steps_match(model, plain_model, llama())
    # Every step's loss went through the fused loss (at least once a step; never unpatched),
    # and with Lomo the head's gradient never existed (AdaLomo's factored moments take the
    # whole gradient, which the fused loss's backward forms).
    assert len(trainer.fused_losses) >= STEPS and plain.fused_losses == []
    assert (trainer.head_gradients == []) == (optim == "lomo") and plain.head_gradients
    assert model.lm_head.weight.grad is None


@pytest.mark.parametrize("patch", [None, "before"])
def test_with_lomo_neither_logits_nor_the_head_gradient_exist(tmp_path, monkeypatch, patch):
    """Vocab 512 x hidden 32: the head's gradient (and the embedding's) is 16,384 elements,
    TRL's logit tiles 4 x 10 x 512 = 20,480; nothing else in a step is that large (MLP
    activations 2,880). Unpatched, TRL's step allocates one of them; patched, with Lomo
    stepping the head from its vocabulary chunks (64 rows at a time here) and the embedding
    from its used rows, no tensor that large exists."""
    from lomo_kernels.integrations import token_metrics
    from lomo_kernels.ops import cross_entropy as lce
    from lomo_kernels.ops.cross_entropy import blocked_backend as blocked

    class WatchedTrainer(SFTTrainer):
        def training_step(self, *args, **kwargs):
            with LargestMatrix() as seen:
                loss = super().training_step(*args, **kwargs)
            self.largest = max(getattr(self, "largest", (0,)), seen.largest)
            return loss

    monkeypatch.setattr(lce, "CHUNK_ELEMENTS", 64 * 32)
    for module in (blocked, token_metrics):  # blocks of 64 words: 44 x 64 logits at most
        monkeypatch.setattr(module, "BLOCK_VOCAB", 64)
    _, trainer = trained(tmp_path, patch=patch, vocab=512, trainer_class=WatchedTrainer)
    assert (trainer.largest[0] < 512 * 32) == (patch is not None), trainer.largest


@pytest.mark.parametrize("optim", ["lomo", "adalomo"])
@pytest.mark.parametrize("clip", [1.0, 0.0], ids=["clip", "no_clip"])
def test_trls_head_over_a_patched_model_is_refused_before_any_change(tmp_path, optim, clip):
    """Patched before the trainer is built, without enable_trl(): TRL's chunked head wraps
    the patched forward. The first step is refused, naming the head weight and enable_trl(),
    and every parameter and optimizer state tensor keeps its bits."""
    model = lomo_kernels.patch_causal_lm(llama())
    lomo_kernels.enable_transformers()
    try:
        trainer = SFTTrainer(
            model=model,
            args=config(tmp_path, optim=optim, max_grad_norm=clip),
            train_dataset=dataset(),
            processing_class=tokenizer(),
        )
        trainer.create_optimizer_and_scheduler(STEPS)
        opt = in_backward_optimizer(trainer.optimizer)
        before = optimizer_snapshot(model, opt)
        with pytest.raises(RuntimeError, match="'lm_head.weight'.*enable_trl"):
            trainer.train()
        assert_unchanged_since(before, model, opt)
    finally:
        lomo_kernels.disable_trl()


def test_bf16_autocast_trains_with_the_fused_head(tmp_path):
    """TRL's default bf16 autocast: the fused head forms fp32 logits from the fp32 weights
    where TRL's head forms them in bf16, so the first step's losses (same weights, same
    body) differ by no more than bf16 rounding of the head can move them. Each logit
    z = sum_i h_i W_i is then formed from h and W rounded to bf16 (u = 2**-8 relative each)
    and rounded itself: |dz| <= (2u + u**2) S + u (|z| + (2u + u**2) S), S = sum_i |h_i W_i|,
    plus fp32's sum (32 terms: 2**-19 S). A token's loss logsumexp(z) - z_label moves by at
    most 2 max |dz|, and so does their mean. S and |z| are taken over every token of the data
    set from the initial weights (fp32; the batch's order is the sampler's): the bound is
    3e-3 of the loss here, measured 8e-5. Later steps start from weights the previous
    updates' roundings moved apart, which this bound does not cover: they are only
    required to train on (finite losses; the token accuracy, 0 on both sides at these sizes,
    equal)."""
    _, plain = trained(tmp_path / "plain", bf16=True)
    _, fused = trained(tmp_path / "fused", patch="after", bf16=True)
    model, u = llama(), 2.0**-8
    weight, worst = model.lm_head.weight.detach(), 0.0
    with torch.no_grad():
        for row in dataset():
            h = model.model(input_ids=torch.tensor([row["input_ids"]])).last_hidden_state[0]
            s, z = h.abs() @ weight.abs().T, h @ weight.T
            dz = (2 * u + u**2) * s + u * (z.abs() + (2 * u + u**2) * s) + 2**-19 * s
            worst = max(worst, dz.max().item())
    first_plain, first_fused = logged(plain, "loss")[0], logged(fused, "loss")[0]
    assert abs(first_fused - first_plain) <= 2 * worst
    assert len(logged(fused, "loss")) == STEPS
    assert all(math.isfinite(loss) for loss in logged(fused, "loss"))
    assert logged(fused, "mean_token_accuracy") == logged(plain, "mean_token_accuracy")


def test_unpatching_restores_trls_head_and_other_fields_are_named(tmp_path):
    model = llama()
    lomo_kernels.enable_transformers()
    try:
        trainer = SFTTrainer(
            model=model,
            args=config(tmp_path),
            train_dataset=dataset(),
            processing_class=tokenizer(),
        )
    finally:
        lomo_kernels.disable_transformers()
    trls_forward = model.forward
    lomo_kernels.patch_causal_lm(model)
    ids = torch.tensor([[5, 6, 7, 8]])
    out = model(input_ids=ids, labels=ids, fused_lm_head=True)
    assert out.log_probs.shape == (1, 3) and out.label_mask.all()
    assert out.mean_logits is None  # not asked for, as TRL's head
    with pytest.raises(AttributeError, match="does not compute aux_loss"):
        _ = out.aux_loss
    lomo_kernels.unpatch_causal_lm(model)
    assert model.forward == trls_forward  # TRL's wrapper again, as before patching
    assert trainer.model(input_ids=ids, labels=ids, fused_lm_head=True).log_probs.shape == (1, 3)


def test_enable_trl_keeps_only_a_patched_head_and_disable_restores_trl():
    from trl.trainer import sft_trainer

    original = sft_trainer.add_fused_lm_head
    lomo_kernels.enable_trl()
    try:
        model = lomo_kernels.patch_causal_lm(llama())
        patched = model.forward
        sft_trainer.add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
        assert model.forward is patched
        sft_trainer.add_fused_lm_head(model, temperature=0.7)  # recorded, served
        assert model.forward is patched
        ids = torch.tensor([[5, 6, 7, 8]])
        cold = model(input_ids=ids, labels=ids, fused_lm_head=True).log_probs
        sft_trainer.add_fused_lm_head(model)
        warm = model(input_ids=ids, labels=ids, fused_lm_head=True).log_probs
        assert not torch.allclose(cold, warm)
        plain = llama()
        sft_trainer.add_fused_lm_head(plain)
        assert "forward" in vars(plain)  # TRL's head on an unpatched model, as without us
    finally:
        lomo_kernels.disable_trl()
    assert sft_trainer.add_fused_lm_head is original


@pytest.mark.parametrize("patch", [None, "before"])
def test_sft_trainer_accumulates_as_with_torchs_sgd(tmp_path, patch):
    """gradient_accumulation_steps=2 over micro-batches of 2 rows: TRL's SFTTrainer with Lomo
    (its head logits-free with `patch`) against the same trainer with torch's SGD."""
    common = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2)
    model, trainer = trained(tmp_path / "lomo", patch=patch, **common)
    reference, sgd = trained(tmp_path / "sgd", optim="sgd", **common)
    opt = in_backward_optimizer(trainer.optimizer)
    assert opt.accumulation_steps == 2 and opt.step_count == STEPS
    assert logged(trainer, "loss") == pytest.approx(logged(sgd, "loss"), rel=LOSS_RTOL, abs=0)
    # Unpatched: the suite's fp32 bound for Lomo against torch.optim.SGD (1e-6 of each
    # tensor); patched: the fused loss's rounding, as the test above bounds it.
    if patch is None:
        assert max_rel_diff(model, reference) <= 1e-6
    else:
        assert_steps_match(model, reference, llama())
