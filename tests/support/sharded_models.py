"""The model, data and training loop shared by the sharded runs and their one-process reference.

A transformers LLaMA with awkward sizes (no size divisible by the world size where it can be
avoided), a large vocabulary so the embedding and head exceed ZeRO-3's default persistence
threshold (1e5 elements) while the small tensors stay persistent, and one 1-element
parameter (fewer elements than ranks: one rank owns only padding).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM  # not inside zero.Init: it patches torch

from support.models import causal_lm_config

WORLD = 2
GLOBAL_BATCH = 4
SEQ = 9
STEPS = 3
LR = {"lomo": 0.05, "adalomo": 0.01}
OPTIONS = {"clip_grad_norm": 0.3, "weight_decay": 0.05}
# Without clipping: a gradient summed over ranks instead of averaged doubles the update
# (with clipping on, the clip coefficient would hide it).
NO_CLIP = {"weight_decay": 0.05}
SINGLE = {**OPTIONS, "single_backward": True}
# Gradient accumulation: each step of ACCUMULATION_STEPS micro-batches of a global batch.
ACCUMULATION_STEPS = 4
ACCUMULATING = {**OPTIONS, "accumulation_steps": ACCUMULATION_STEPS}
# The 8-bit blockwise buffer: each rank's buffer holds its slice's blocks, cut at its edges.
ACCUMULATING_INT8 = {**ACCUMULATING, "accumulation_dtype": torch.int8}
NO_CLIP_ACCUMULATING = {**NO_CLIP, "accumulation_steps": ACCUMULATION_STEPS}
# The overflow runs: an inf in the POISONED_MICRO_BATCH-th micro-batch's gradient on one
# rank only; label -> (optimizer, parameter dtype, options). Without clipping in fp32 the
# all-reduced overflow flag alone carries the decision (no norm is all-reduced that an inf
# would poison); fp16 lowers the (dynamic) loss scale.
POISONED_MICRO_BATCH = 1
OVERFLOW_RUNS = {
    "lomo": ("lomo", torch.float32, ACCUMULATING),
    "lomo_no_clip": ("lomo", torch.float32, NO_CLIP_ACCUMULATING),
    "adalomo_no_clip": ("adalomo", torch.float32, NO_CLIP_ACCUMULATING),
    "lomo_fp16": ("lomo", torch.float16, NO_CLIP_ACCUMULATING),
}
SHORT_STEP = 2  # micro-batches of the short step that ends train_accumulating


class ScaledLlama(nn.Module):
    """LlamaForCausalLM whose logits are multiplied by a learned 1-element temperature."""

    def __init__(self) -> None:
        super().__init__()
        self.llama = LlamaForCausalLM(self.config())
        self.temperature = nn.Parameter(torch.ones(1))

    TIED = False  # whether the head is the embedding's Parameter

    @classmethod
    def config(cls) -> LlamaConfig:
        return causal_lm_config(
            vocab_size=3001, hidden_size=40, intermediate_size=73, tie_word_embeddings=cls.TIED
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits = self.llama(input_ids=input_ids).logits * self.temperature
        shift = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
        return nn.functional.cross_entropy(shift, input_ids[:, 1:].reshape(-1))


class TiedScaledLlama(ScaledLlama):
    """ScaledLlama whose head is its embedding (one Parameter, trained once per step)."""

    TIED = True


# The options the sharded runs of test_sharded_options.py combine: clipping by value and by
# norm together (each binds at this model's gradients), and a group of the norms and the
# temperature with its own lr and no decay; FROZEN: the prefix of the parameters frozen.
COMBINED = {"clip_grad_norm": 0.3, "clip_grad_value": 0.002, "weight_decay": 0.05}
FROZEN = "llama.model.layers.0."


def freeze_first_layer(model: nn.Module) -> None:
    """Freezes the first decoder layer (a model's frozen part, kept bit for bit)."""
    for name, param in model.named_parameters():
        if name.startswith(FROZEN):
            param.requires_grad_(False)


def combined_options(model: nn.Module, name: str, accumulate: bool, **changes) -> dict:
    """COMBINED with the group of `model`'s trainable norms and temperature (by name, half of
    LR[name], no decay) and, with `accumulate`, ACCUMULATION_STEPS; `changes` replace any."""
    grouped = [
        n for n, p in model.named_parameters() if p.requires_grad and ("norm" in n or "temp" in n)
    ]
    group = {"params": grouped, "lr": LR[name] / 2, "weight_decay": 0.0}
    steps = {"accumulation_steps": ACCUMULATION_STEPS} if accumulate else {}
    return {**COMBINED, "param_groups": [group], **steps, **changes}


class FusedHeadLlama(nn.Module):
    """ScaledLlama's LLaMA without the temperature, its loss logits-free (patch_causal_lm)."""

    def __init__(self) -> None:
        from lomo_kernels import patch_causal_lm

        super().__init__()
        self.llama = patch_causal_lm(LlamaForCausalLM(ScaledLlama.config()))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.llama(input_ids=input_ids, labels=input_ids).loss


def global_batch(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, 3001, (GLOBAL_BATCH, SEQ), generator=gen)


def rank_batch(step: int, rank: int) -> torch.Tensor:
    per = GLOBAL_BATCH // WORLD
    return global_batch(step)[rank * per : (rank + 1) * per]


def train(model: nn.Module, opt, batch_of, steps: int = STEPS) -> None:
    """A forward per pass: grad_norm(model(x)) then fused_backward(model(x))."""
    for step in range(steps):
        x = batch_of(step)
        if opt.clip_grad_norm is not None:
            opt.grad_norm(model(x))
        opt.fused_backward(model(x))
    opt.flush_report()


def train_one_loss(model: nn.Module, opt, batch_of, steps: int = STEPS) -> None:
    """lomo-optim's pattern, one forward per step: grad_norm(loss) then fused_backward(loss)."""
    for step in range(steps):
        loss = model(batch_of(step))
        if opt.clip_grad_norm is not None:
            opt.grad_norm(loss)
        opt.fused_backward(loss)
    opt.flush_report()


def train_accumulating(
    model: nn.Module, opt, batch_of, steps: int = STEPS, after_call=None
) -> None:
    """accumulation_steps=k: k micro-batches per step, batch `k * step + i`, each loss / k;
    then a short step of SHORT_STEP micro-batches applied by `opt.step()` (a Trainer's end of
    an epoch), each loss / SHORT_STEP: steps + 1 steps in all. `after_call(micro_batch,
    step_count_before)`, if given, after each `fused_backward` (micro_batch True) and the
    `step()` (False): a call that applied a step raised `opt.step_count`."""

    def call(method, *args) -> None:
        before = opt.step_count
        method(*args)
        if after_call is not None:
            after_call(method is not opt.step, before)

    k = opt.accumulation_steps
    for step in range(steps):
        for i in range(k):
            call(opt.fused_backward, model(batch_of(k * step + i)) / k)
    for i in range(SHORT_STEP):
        call(opt.fused_backward, model(batch_of(k * steps + i)) / SHORT_STEP)
    call(opt.step)
    opt.flush_report()


def train_single(model: nn.Module, opt, batch_of, steps: int = STEPS) -> list[float]:
    """single_backward=True: one forward and one backward per step; returns the step norms."""
    norms = []
    for step in range(steps):
        opt.fused_backward(model(batch_of(step)))
        norms.append(float(opt.last_grad_norm))
    opt.flush_report()
    return norms


PATTERNS = {"per_pass": train, "one_loss": train_one_loss}


def parts_batch(rank: int) -> torch.Tensor:
    """Rank `rank`'s 5 rows for LayerInTwoCheckpoints (the global batch: both ranks')."""
    return torch.randn(5, 40, generator=torch.Generator().manual_seed(rank))


# label -> (optimizer name, options): with a norm pass (clipping), and without one.
GRADIENT_IN_PARTS = {
    "lomo_clip": ("lomo", {"clip_grad_norm": 0.3, "weight_decay": 0.1}),
    "adalomo": ("adalomo", {"weight_decay": 0.1}),
}


# A parameter frozen when the optimizer was built and unfrozen since: refused as in one
# process (it has no hook, so it would get no step and keep its gradient).
UNFROZEN_REFUSAL = "'layer.bias' is trainable but has no hook (unfrozen or replaced)"


def unfrozen_after_construction(model: nn.Module, build_optimizer, rank: int) -> str | None:
    """Freezes `model.layer` (of a sharded LayerInTwoCheckpoints, non-reentrant), builds the
    optimizer (`build_optimizer()`), unfreezes the layer and runs a step: the refusal's
    message, or None."""
    for p in model.layer.parameters():
        p.requires_grad_(False)
    opt = build_optimizer()
    for p in model.layer.parameters():
        p.requires_grad_(True)
    try:
        opt.fused_backward(model(parts_batch(rank)))
    except RuntimeError as exc:
        return str(exc)
    return None


# How the option runs train (test_sharded_options.py): a norm pass and an update pass per
# step (a forward each), or k micro-batches per step.
TRAININGS = {"per_step": train, "accumulating": train_accumulating}
