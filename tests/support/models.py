"""Small transformers causal LMs (LLaMA, Mistral, Qwen2, Qwen3), their batches, an MLP, and
comparisons of trained weights."""

from __future__ import annotations

import copy

import torch

from support.float64 import ulp

# The tests' model sizes: every op kind of a LLaMA-family model, small enough for CPU runs.
TINY = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=72,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
# transformers' (config, model) class names of each causal-LM family the tests build: the
# four they train, and gemma2, which patch_causal_lm refuses.
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
}


def causal_lm_config(family: str = "llama", **sizes):
    """The transformers config of `family` with TINY's sizes, `sizes` replacing any."""
    import transformers

    return getattr(transformers, FAMILIES[family][0])(**(TINY | sizes))


def causal_lm(
    family: str = "llama", dtype: torch.dtype = torch.float32, seed: int = 0, **sizes
) -> torch.nn.Module:
    """A causal LM of `causal_lm_config(family, **sizes)`, initialised from `seed`, in
    `dtype` and training mode."""
    import transformers

    config = causal_lm_config(family, **sizes)
    torch.manual_seed(seed)
    return getattr(transformers, FAMILIES[family][1])(config).to(dtype).train()


def tiny_llama(dtype=torch.float32, seed=0, tie_word_embeddings=False, **overrides):
    """A LLaMA of TINY's sizes (`overrides` replacing any)."""
    return causal_lm("llama", dtype, seed, tie_word_embeddings=tie_word_embeddings, **overrides)


def batch(step, vocab=96, batch_size=2, seq=12):
    gen = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, vocab, (batch_size, seq), generator=gen)
    return {"input_ids": ids, "labels": ids}


def clone(model):
    return copy.deepcopy(model)


def max_rel_diff(a, b):
    """Max over parameters of max|a - b| / max|b| (per-tensor relative difference)."""
    worst = 0.0
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        scale = pb.detach().double().abs().max().clamp_min(1e-12)
        worst = max(
            worst, ((pa.detach().double() - pb.detach().double()).abs().max() / scale).item()
        )
    return worst


def max_abs_diff(a, b):
    return max(
        (pa.detach().double() - pb.detach().double()).abs().max().item()
        for pa, pb in zip(a.parameters(), b.parameters(), strict=True)
    )


def mlp() -> torch.nn.Module:
    """A two-layer perceptron (6 -> 8 -> 3), seeded."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


class LayerInTwoCheckpoints(torch.nn.Module):
    """One layer (40 x 40) applied in two checkpoint segments, then a head, seeded.
    Reentrant segments each run a backward of their own, so the layer's gradient reaches
    its hook in two parts (refused in one process and under ZeRO-3; FSDP2 sums the parts
    before its reduce); non-reentrant ones give it whole (the reference)."""

    def __init__(self, reentrant: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.reentrant = reentrant
        self.layer = torch.nn.Linear(40, 40)
        self.head = torch.nn.Linear(40, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            x = torch.utils.checkpoint.checkpoint(
                lambda t: torch.tanh(self.layer(t)), x, use_reentrant=self.reentrant
            )
        return self.head(x).float().pow(2).mean()


def loss_of(model: torch.nn.Module, step: int) -> torch.Tensor:
    """The loss of step `step`'s batch: `mlp`'s inputs, or `batch` for a causal LM."""
    if isinstance(model, torch.nn.Sequential):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step))
        return model(x.to(model[0].weight.dtype)).float().pow(2).mean()
    return model(**batch(step)).loss


def assert_steps_match(fused: torch.nn.Module, plain: torch.nn.Module, start: torch.nn.Module):
    """fp32 runs of the fused head and the unfused one: every parameter within 4 ulps of its
    value or 1e-4 of its tensor's largest update over the run (`start` to `plain`)."""
    for (name, a), b, s in zip(
        fused.named_parameters(), plain.parameters(), start.parameters(), strict=True
    ):
        a64, b64 = a.detach().double(), b.detach().double()
        largest_update = (b64 - s.detach().double()).abs().max().item()
        bound = torch.maximum(
            4 * ulp(b64, torch.float32), torch.full_like(b64, 1e-4 * largest_update)
        )
        worst = ((a64 - b64).abs() / bound).max().item()
        assert worst <= 1.0, f"{name}: {worst:.3g} x the bound"
