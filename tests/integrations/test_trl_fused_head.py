"""The logits-free head serving TRL's DPO and GRPO: per-token log-probs (policy and
reference), statistics and temperature from the fused head, against float64 and against
the same trainers unpatched (TRL's own chunked head) with torch's SGD and with Lomo; with
Lomo the head's gradient never exists and no tokens x vocabulary tensor is allocated."""

from __future__ import annotations

import pytest
import torch
from support.allocations import LargestMatrix, formed_gradients
from support.models import assert_steps_match, max_rel_diff
from support.state import same_bits, snapshot

import lomo_kernels
from lomo_kernels.integrations import token_metrics

try:  # a test dependency, as in test_trl.py
    import transformers
    from test_trl import llama, logged
    from test_trl import trl as trl  # the fixture requiring TRL, shared
    from test_trl_preference import COMMON, RL, pairs, prompts, tokenizer
    from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    from lomo_kernels.integrations.huggingface import in_backward_optimizer
except ImportError:
    DPOTrainer = None

# The fused log-probs against TRL's chunked head: both accumulate fp32 logits over the
# vocabulary in different orders, a few u of each log-prob (test_trl bounds the SFT loss at
# 64 u); a DPO/GRPO loss is a smooth function of their sums, so it inherits that relative
# bound times the condition of the loss (measured below 1e-6 relative on these runs).
LOSS_RTOL = 1e-5
# GRPO's loss is a mean of advantage-weighted ratios, terms of magnitude ~1 that cancel (the
# advantages sum to 0): its rounding is absolute, LOSS_RTOL of those terms (measured 3e-8).
LOSS_ATOL = 1e-5
VOCAB = 512


def low_words(completions, **_):
    """A rule with spread over VOCAB words: how many words of the completion are below t256."""
    return [float(sum(int(w[1:]) < 256 for w in c.split() if w[1:].isdigit())) for c in completions]


def _float64(hidden, weight, labels, temperature):
    z = hidden.double() @ weight.double().T / temperature
    logp = torch.log_softmax(z, dim=-1)
    p = logp.exp()
    counted = labels != -100
    safe = labels.clamp(min=0)
    values = {
        "log_probs": logp.gather(-1, safe[..., None]).squeeze(-1),
        "entropy": -(p * logp).sum(-1),
        "log_sum_sq_probs": torch.log((p * p).sum(-1)),
        "mean_logits": z.mean(-1),
    }
    values = {k: torch.where(counted, v, 0.0) for k, v in values.items()}
    values["is_top1"] = (z.argmax(-1) == labels) & counted
    return values


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("blocks", [(4096, 1024), (7, 5)], ids=["one_block", "many_blocks"])
def test_token_statistics_at_a_temperature_against_float64(monkeypatch, temperature, blocks):
    """Every statistic within 1e-5 of float64 (fp32 logits of width 16: ~1e-6), the argmax
    exact, over one block and over blocks of 7 words x 5 tokens."""
    monkeypatch.setattr(token_metrics, "BLOCK_VOCAB", blocks[0])
    monkeypatch.setattr(token_metrics, "BLOCK_TOKENS", blocks[1])
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 9, 16, generator=gen)
    weight = torch.randn(41, 16, generator=gen)
    labels = torch.randint(0, 41, (3, 9), generator=gen)
    labels[0, :2] = -100
    stats = token_metrics.token_statistics(hidden, weight, labels, temperature=temperature)
    ref = _float64(hidden, weight, labels, temperature)
    for name in ("entropy", "log_sum_sq_probs", "mean_logits"):
        torch.testing.assert_close(stats[name].double(), ref[name], rtol=0, atol=1e-5)
    assert torch.equal(stats["is_top1"], ref["is_top1"])


def test_token_statistics_computes_only_the_fields_asked_and_refuses_unknown_ones():
    """A subset of the statistics is the whole call's values of those fields alone; a field
    that is not computed (a misspelt or newer TRL name) is refused naming it, not answered
    with zeros."""
    gen = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(2, 5, 16, generator=gen), torch.randn(23, 16, generator=gen)
    labels = torch.randint(0, 23, (2, 5), generator=gen)
    every = token_metrics.token_statistics(hidden, weight, labels)
    asked = ("mean_logits", "is_top1")
    some = token_metrics.token_statistics(hidden, weight, labels, fields=asked)
    assert set(some) == set(asked)
    for name in asked:
        assert torch.equal(some[name], every[name]), name
    with pytest.raises(ValueError, match=r"\['mean_logit'\] are not computed .*mean_logits"):
        token_metrics.token_statistics(hidden, weight, labels, fields=("entropy", "mean_logit"))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_patched_forward_answers_what_trls_head_is_asked(temperature):
    """add_fused_lm_head(model, temperature, outputs=...) after enable_trl(): the patched
    forward's log-probs (with gradient) and the statistics asked for (None for the others)
    against float64 log_softmax of the model's own last hidden states and head."""
    from trl.trainer import grpo_trainer

    model = lomo_kernels.patch_causal_lm(llama())
    lomo_kernels.enable_trl()
    try:
        grpo_trainer.add_fused_lm_head(model, temperature, outputs=("log_probs", "entropy"))
    finally:
        lomo_kernels.disable_trl()
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(1))
    labels = ids.masked_fill(torch.arange(11) < 3, -100)
    out = model(input_ids=ids, labels=labels, fused_lm_head=True)
    assert out.log_sum_sq_probs is None and out.mean_logits is None and out.is_top1 is None
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
    ref = _float64(hidden, model.lm_head.weight, labels[:, 1:], temperature)
    torch.testing.assert_close(out.log_probs.double(), ref["log_probs"], rtol=0, atol=1e-5)
    torch.testing.assert_close(out.entropy.double(), ref["entropy"], rtol=0, atol=1e-5)
    assert out.log_probs.requires_grad and not out.entropy.requires_grad
    with pytest.raises(ValueError, match="does not compute aux_loss"):
        lomo_kernels.integrations.causal_lm.set_fused_head(model, 1.0, ("aux_loss",))


HIDDEN = 32
# Every micro-batch scores more than 16 positions (DPO: 4 rows of 7 or more, GRPO: 2 rows of
# 9), so a tokens x vocabulary tensor has at least 16 x VOCAB elements.
LOGITS_ELEMENTS = 16 * VOCAB


class LargestNotHidden(LargestMatrix):
    """The largest matrix whose last dimension is not the hidden width (so neither hidden
    states, nor the head's weight, row blocks or accumulation buffer: logits would be),
    outside generation (whose logits are the sampler's own, one position per row)."""

    paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.paused:
            return func(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            logits_like = isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] != HIDDEN
            if logits_like and t.numel() > self.largest[0]:
                self.largest = (t.numel(), tuple(t.shape), str(func))
        return out


class Watched:
    """A trainer mixin: the largest such matrix any training step allocates."""

    def training_step(self, *args, **kwargs):
        with LargestNotHidden() as self._seen:
            loss = super().training_step(*args, **kwargs)
        self.largest = max(getattr(self, "largest", (0,)), self._seen.largest)
        return loss

    def _generate(self, *args, **kwargs):
        self._seen.paused = True
        try:
            return super()._generate(*args, **kwargs)
        finally:
            self._seen.paused = False


class WatchedDPO(Watched, DPOTrainer if DPOTrainer else object):
    pass


class WatchedGRPO(Watched, GRPOTrainer if DPOTrainer else object):
    pass


class WatchedRLOO(Watched, RLOOTrainer if DPOTrainer else object):
    pass


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks and chunks of 64 vocabulary rows, so that a logits-free step's largest
    matrix is far below the head's 512 x 32."""
    from lomo_kernels.ops import cross_entropy as lce
    from lomo_kernels.ops.cross_entropy import blocked_backend as blocked

    monkeypatch.setattr(lce, "CHUNK_ELEMENTS", 64 * 32)
    for module in (blocked, token_metrics):
        monkeypatch.setattr(module, "BLOCK_VOCAB", 64)


def saved_llama(path):
    """The tiny LLaMA of VOCAB words, saved and loaded back: GRPO builds its reference model
    from the policy's config path."""
    llama(VOCAB).save_pretrained(path)
    return transformers.LlamaForCausalLM.from_pretrained(path).train()


def run(kind, tmp_path, optim, patch, **overrides):
    """(model, trainer) after COMMON's 2 steps of 2 micro-batches."""
    lomo_kernels.enable_trl()
    try:
        if kind == "dpo":
            model = llama(VOCAB)
            if patch:
                lomo_kernels.patch_causal_lm(model)
            trainer = WatchedDPO(
                model=model,
                ref_model=llama(VOCAB),
                args=DPOConfig(**(COMMON | overrides), output_dir=str(tmp_path), optim=optim),
                train_dataset=pairs(),
                processing_class=tokenizer(VOCAB),
            )
        else:
            model = saved_llama(tmp_path / "start")
            if patch:
                lomo_kernels.patch_causal_lm(model)
            rl = dict(RL, temperature=0.7, beta=0.04)
            if kind == "grpo":
                rl["top_entropy_quantile"] = 0.5
            config, trainer_class = {
                "grpo": (GRPOConfig, WatchedGRPO),
                "rloo": (RLOOConfig, WatchedRLOO),
            }[kind]
            trainer = trainer_class(
                model=model,
                reward_funcs=low_words,
                args=config(**(COMMON | rl | overrides), output_dir=str(tmp_path), optim=optim),
                train_dataset=prompts(),
                processing_class=tokenizer(VOCAB),
            )
        # Every gradient autograd computes for the head's weight (none when Lomo steps it
        # from its vocabulary chunks inside the fused loss's backward).
        trainer.head_gradients = formed_gradients(model.lm_head.weight)
        trainer.train()
    finally:
        lomo_kernels.disable_trl()
    return model, trainer


@pytest.mark.parametrize("kind", ["dpo", "grpo", "rloo"])
def test_patched_head_with_lomo_equals_trls_head_with_sgd_and_lomo(tmp_path, small_blocks, kind):
    """DPO (reference model patched too), GRPO and RLOO (temperature 0.7, num_iterations=2,
    steps_per_generation=4, beta > 0: a reference model TRL builds and the patch serves;
    GRPO with top_entropy_quantile=0.5: the entropies mask the loss),
    gradient_accumulation_steps=2,
    clipped at 1.0: the patched run with Lomo gives the parameters of the unpatched run with
    optim="sgd" and with Lomo within the fused head's rounding (assert_steps_match: 4 ulps,
    or 1e-4 of the tensor's largest update), the losses and norms within LOSS_RTOL. The
    head's gradient is never computed (a hook on the weight never fires; unpatched it fires
    each micro-batch), its .grad never set, and no step allocates a tokens x vocabulary
    matrix (TRL's own head, unpatched, does: its logit tiles are tokens x 32768)."""
    model, trainer = run(kind, tmp_path / "fused", "lomo", patch=True)
    plain, plain_lomo = run(kind, tmp_path / "plain", "lomo", patch=False)
    reference, sgd = run(kind, tmp_path / "sgd", "sgd", patch=False)
    opt = in_backward_optimizer(trainer.optimizer)
    assert type(opt).__name__ == "Lomo" and opt.accumulation_steps == 2 and opt.step_count == 2
    start = llama(VOCAB)
    assert max_rel_diff(reference, start) > 1e-4  # it trained
    assert_steps_match(model, reference, start)
    assert_steps_match(model, plain, start)
    for other in (sgd, plain_lomo):
        losses = logged(other, "loss")
        assert logged(trainer, "loss") == pytest.approx(losses, rel=LOSS_RTOL, abs=LOSS_ATOL)
        norms = logged(trainer, "grad_norm")
        assert norms == pytest.approx(logged(other, "grad_norm"), rel=LOSS_RTOL)
    if kind == "grpo":
        assert logged(trainer, "entropy") == pytest.approx(logged(sgd, "entropy"), rel=1e-5)
    assert model.lm_head.weight.grad is None
    assert trainer.head_gradients == [] and len(plain_lomo.head_gradients) >= 4
    assert trainer.largest[0] < LOGITS_ELEMENTS <= plain_lomo.largest[0], (
        trainer.largest,
        plain_lomo.largest,
    )


def test_entropy_bonus_and_fp32_head_cast_are_refused_by_name(tmp_path):
    """GRPO's entropy bonus differentiates the entropy (the fused head's has no gradient) and
    cast_lm_head_to_fp32 replaces the head's forward: both refused when the trainer is
    built, naming the option, every parameter unchanged."""
    for option, match in (
        (dict(entropy_coef=0.01), "entropy_coef=0.01.*no gradient"),
        (dict(use_adaptive_entropy=True), "use_adaptive_entropy=True.*no gradient"),
        (dict(cast_lm_head_to_fp32=True), "cast_lm_head_to_fp32=True"),
    ):
        model = lomo_kernels.patch_causal_lm(llama())
        before = snapshot(model)
        lomo_kernels.enable_trl()
        try:
            with pytest.raises(ValueError, match=match):
                GRPOTrainer(
                    model=model,
                    reward_funcs=low_words,
                    args=GRPOConfig(
                        **COMMON, output_dir=str(tmp_path), optim="lomo", **RL, **option
                    ),
                    train_dataset=prompts(),
                    processing_class=tokenizer(),
                )
        finally:
            lomo_kernels.disable_trl()
        assert same_bits(before, snapshot(model))


@pytest.mark.parametrize("kind", ["dpo", "grpo"])
def test_adalomo_with_the_patched_head_equals_trls_head(tmp_path, small_blocks, kind):
    """AdaLomo (the head's gradient built chunk by chunk, then its factored step), with
    accumulation: the patched run's parameters equal the unpatched AdaLomo run's within the
    fused head's rounding (assert_steps_match), and no step holds logits."""
    model, trainer = run(kind, tmp_path / "fused", "adalomo", patch=True, learning_rate=1e-2)
    plain, plain_trainer = run(kind, tmp_path / "plain", "adalomo", patch=False, learning_rate=1e-2)
    assert type(in_backward_optimizer(trainer.optimizer)).__name__ == "AdaLomo"
    start = llama(VOCAB)
    assert max_rel_diff(plain, start) > 1e-4
    assert_steps_match(model, plain, start)
    assert trainer.largest[0] < LOGITS_ELEMENTS <= plain_trainer.largest[0]
