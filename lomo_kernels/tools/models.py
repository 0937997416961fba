"""Shapes of LLaMA-architecture models: named presets and Hugging Face configs.

The estimator describes a model by its shape only (no weights), so a 65B model can be
reasoned about on a laptop; the benchmarks build random-weight models of a shape
(bench/common/models.py). Parameter counts follow the LLaMA layout of
`transformers.LlamaForCausalLM`: embedding, per layer q/k/v/o projections, gate/up/down MLP
projections and two RMSNorm weights, a final RMSNorm and an untied lm_head.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# ModelShape's fields as a Hugging Face LLaMA config names them.
HF_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "tie_word_embeddings": "tie_word_embeddings",
}
# What a config must give; the rest defaults (one head, no grouped-query attention, untied).
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers")


@dataclass(frozen=True)
class ModelShape:
    """The dimensions that decide a LLaMA-architecture model's memory."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{self.name}: {field} must be positive")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.name}: hidden_size must divide by num_heads and num_heads by num_kv_heads"
            )

    @property
    def kv_size(self) -> int:
        """Width of the k and v projections (grouped-query attention shrinks them)."""
        return self.hidden_size // self.num_heads * self.num_kv_heads

    def layer_tensor_numels(self) -> list[int]:
        h, i = self.hidden_size, self.intermediate_size
        return [h * h, h * self.kv_size, h * self.kv_size, h * h, h * i, h * i, h * i, h, h]

    def tensor_numels(self) -> list[int]:
        """numel of every parameter tensor, in module order."""
        embed = self.vocab_size * self.hidden_size
        out = [embed] + self.layer_tensor_numels() * self.num_layers + [self.hidden_size]
        if not self.tie_word_embeddings:
            out.append(embed)
        return out

    @property
    def num_parameters(self) -> int:
        return sum(self.tensor_numels())

    @property
    def largest_tensor_numel(self) -> int:
        return max(self.tensor_numels())

    def matrix_shapes(self) -> list[tuple[int, int]]:
        """(rows, cols) of every 2-D parameter; 1-D ones (norms) are (numel, 0)."""
        h, i, kv, v = self.hidden_size, self.intermediate_size, self.kv_size, self.vocab_size
        layer = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i), (h, 0), (h, 0)]
        out = [(v, h)] + layer * self.num_layers + [(h, 0)]
        if not self.tie_word_embeddings:
            out.append((v, h))
        return out

    def to_hf_config(self, **settings: Any) -> Any:
        """A `transformers.LlamaConfig` of this shape (imports transformers); `settings`: its
        other fields (e.g. max_position_embeddings)."""
        from transformers import LlamaConfig

        shape = {key: getattr(self, field) for field, key in HF_KEYS.items()}
        return LlamaConfig(**shape, **settings)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _llama(name: str, h: int, i: int, layers: int, heads: int, vocab: int = 32000) -> ModelShape:
    return ModelShape(name, vocab, h, i, layers, heads, heads)


PRESETS: dict[str, ModelShape] = {
    # LLaMA-1 (Touvron et al. 2023), the models of the LOMO paper.
    "llama-7b": _llama("llama-7b", 4096, 11008, 32, 32),
    "llama-13b": _llama("llama-13b", 5120, 13824, 40, 40),
    "llama-30b": _llama("llama-30b", 6656, 17920, 60, 52),
    "llama-65b": _llama("llama-65b", 8192, 22016, 80, 64),
    # Llama 3.2 1B (grouped-query attention, 128K vocabulary, tied embeddings) and Llama 3 8B.
    "llama-3-1b": ModelShape("llama-3-1b", 128256, 2048, 8192, 16, 32, 8, True),
    "llama-3-8b": ModelShape("llama-3-8b", 128256, 4096, 14336, 32, 32, 8),
    # A 1B shape of LLaMA-1's proportions: hidden 2048, 16 layers, LLaMA's MLP width rule
    # (8/3 x hidden rounded up to 256), 16 heads of 128.
    "llama-1b": _llama("llama-1b", 2048, 5632, 16, 16),
    # The 168M model of the project's CPU memory measurements.
    "llama-168m": _llama("llama-168m", 1024, 2816, 8, 16),
    # Small enough for a CPU test or a demo in seconds.
    "llama-20m": _llama("llama-20m", 256, 688, 4, 4),
    # For tests and `bench.train` on a CPU in seconds: 8.6M parameters, 95% of them in the
    # embedding and the head (a 32000 vocabulary), so the optimizers' state dominates.
    "tiny": _llama("tiny", 128, 344, 2, 4),
}


# The model types whose layout ModelShape counts exactly (no biases, a dense MLP).
LLAMA_LAYOUTS = ("llama", "mistral")


def _whole_number(name: str, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: {key} must be a whole number > 0, got {value!r}")
    return value


def _layout_refusal(cfg: Mapping[str, Any], hidden: int, heads: int) -> str | None:
    """What of the config the LLaMA layout does not count, or None."""
    kind = cfg.get("model_type")
    if kind is not None and kind not in LLAMA_LAYOUTS:
        return f"model_type {kind!r}"
    experts = next((k for k in ("num_local_experts", "num_experts") if cfg.get(k)), None)
    if experts:
        return f"{experts}={cfg[experts]!r} (a mixture of experts)"
    biased = next((k for k in ("attention_bias", "mlp_bias") if cfg.get(k)), None)
    if biased:
        return f"{biased}=true"
    head_dim = cfg.get("head_dim")
    if head_dim is not None and head_dim != hidden // heads:
        return f"head_dim={head_dim!r} (not hidden_size / num_attention_heads = {hidden // heads})"
    return None


def _from_mapping(name: str, cfg: Any) -> ModelShape:
    if not isinstance(cfg, Mapping):
        raise ValueError(f"{name}: a config is a JSON object, got a {type(cfg).__name__}")
    missing = [HF_KEYS[field] for field in REQUIRED_FIELDS if HF_KEYS[field] not in cfg]
    if missing:
        raise ValueError(
            f"{name}: not a LLaMA-style config (missing {', '.join(missing)}); give a "
            "config.json of a LLaMA-architecture model or one of: " + ", ".join(PRESETS)
        )
    sizes = {
        field: _whole_number(name, HF_KEYS[field], cfg[HF_KEYS[field]]) for field in REQUIRED_FIELDS
    }
    heads_key, kv_heads_key = HF_KEYS["num_heads"], HF_KEYS["num_kv_heads"]
    heads, kv_heads = cfg.get(heads_key), cfg.get(kv_heads_key)
    sizes["num_heads"] = 1 if heads is None else _whole_number(name, heads_key, heads)
    # Without grouped-query attention a config may leave the key-value heads out (or null).
    sizes["num_kv_heads"] = (
        sizes["num_heads"] if kv_heads is None else _whole_number(name, kv_heads_key, kv_heads)
    )
    refusal = _layout_refusal(cfg, sizes["hidden_size"], sizes["num_heads"])
    if refusal is not None:
        raise ValueError(
            f"{name}: {refusal}: estimate counts the LLaMA layout ({', '.join(LLAMA_LAYOUTS)}: "
            "no biases, a dense MLP, head_dim = hidden_size / num_attention_heads), which "
            "this model is not: its numbers would be wrong"
        )
    tied = cfg.get("tie_word_embeddings") or False
    if not isinstance(tied, bool):
        raise ValueError(f"{name}: tie_word_embeddings must be true or false, got {tied!r}")
    return ModelShape(name, **sizes, tie_word_embeddings=tied)


def resolve_model(model: str | Mapping[str, Any] | Any) -> ModelShape:
    """A ModelShape from a preset name, a config.json path (or its folder), a dict or an HF config.

    Raises ValueError naming the presets when `model` is none of these.
    """
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, Mapping):
        return _from_mapping(str(model.get("_name_or_path") or "config"), model)
    if hasattr(model, "to_dict"):  # transformers.PretrainedConfig
        return _from_mapping(type(model).__name__, model.to_dict())
    key = str(model).lower()
    if key in PRESETS:
        return PRESETS[key]
    path = Path(str(model))
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as error:  # JSONDecodeError is a ValueError
            raise ValueError(f"{path} is not a JSON config ({error})") from None
        return _from_mapping(str(model), config)
    raise ValueError(
        f"unknown model {model!r}: use a preset ({', '.join(PRESETS)}) or the path of a "
        "Hugging Face config.json (or of the folder holding it)"
    )
