"""Lomo / AdaLomo built from transformers' TrainingArguments, as its Trainer builds optimizers.

Used by both ways in (``LomoTrainer`` and ``enable_transformers()``'s ``optim="lomo"``):

- ``learning_rate``; ``max_grad_norm`` as ``clip_grad_norm`` (0: no clipping);
- ``weight_decay`` on the parameters ``Trainer.get_decay_parameter_names`` names, none on the
  others (norm weights and biases), as transformers' Trainer does for every optimizer: two
  param groups;
- ``gradient_accumulation_steps`` as ``accumulation_steps`` (micro-batches per step);
- ``optim_args="accumulation_dtype=int8"`` (or fp32, bf16, fp16): the accumulation buffer's
  dtype (default: the parameter's), with ``gradient_accumulation_steps`` > 1;
- ``optim_args="single_backward=True"``: clipping (and fp16 overflow checks) inside one
  backward per step. The default, False, runs the norm pass first, so a clipped step takes
  two backward passes and is exactly the clipped step of transformers' other optimizers
  (``min(1, max_grad_norm / ||g||) * g``); True costs about 0.6 of that step's time, with the
  bounded approximation of ``Lomo``'s docstring (docs/usage.md, "One backward per step").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from transformers import TrainingArguments
from transformers.trainer_optimizer import _parse_optim_args
from transformers.utils import logging

from ..optim import AdaLomo, Lomo
from ..optim._in_backward import InBackwardOptimizer

logger = logging.get_logger(__name__)

_TRUE, _FALSE = {"true", "1", "yes"}, {"false", "0", "no"}


def _boolean(key: str, text: str) -> bool:
    value = text.strip().lower()
    if value not in _TRUE | _FALSE:
        raise ValueError(f"TrainingArguments(optim_args='{key}={text}'): use {key}=True or False")
    return value in _TRUE


_BUFFER_DTYPES = {
    "int8": torch.int8,
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def _buffer_dtype(key: str, text: str) -> torch.dtype:
    value = text.strip().lower()
    if value not in _BUFFER_DTYPES:
        raise ValueError(
            f"TrainingArguments(optim_args='{key}={text}'): use one of {', '.join(_BUFFER_DTYPES)}"
        )
    return _BUFFER_DTYPES[value]


# The optim_args keys an in-backward optimizer takes, with their parsers.
OPTIM_ARGS: dict[str, Callable[[str, str], Any]] = {
    "single_backward": _boolean,
    "accumulation_dtype": _buffer_dtype,
}


def optimizer_class(optim: Any) -> type[InBackwardOptimizer]:
    """Lomo or AdaLomo for TrainingArguments.optim ("lomo" / "adalomo")."""
    name = str(getattr(optim, "value", optim)).lower()
    if name not in ("lomo", "adalomo"):
        raise ValueError(f"TrainingArguments(optim='lomo' or 'adalomo') is needed, got {name!r}")
    return Lomo if name == "lomo" else AdaLomo


def parse_optim_args(optim_args: dict[str, str]) -> dict[str, Any]:
    """The in-backward options of TrainingArguments.optim_args (already split into a dict)."""
    unknown = set(optim_args) - set(OPTIM_ARGS)
    if unknown:
        raise ValueError(
            f"TrainingArguments(optim_args=...) sets {sorted(unknown)}, which Lomo/AdaLomo do "
            f"not take from the Trainer; accepted: {', '.join(sorted(OPTIM_ARGS))}"
        )
    return {key: OPTIM_ARGS[key](key, text) for key, text in optim_args.items()}


def decay_param_groups(
    model: nn.Module, decay_names: Iterable[str], weight_decay: float
) -> list[dict[str, Any]]:
    """transformers' split: `weight_decay` on the trainable parameters named in `decay_names`,
    0 on the other trainable ones (empty groups left out)."""
    decay_names = set(decay_names)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if name in decay_names else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]


def optimizer_kwargs(
    args: TrainingArguments, model: nn.Module, decay_names: Iterable[str], max_grad_norm: float
) -> dict[str, Any]:
    """Keyword arguments of Lomo/AdaLomo(model, ...) for these TrainingArguments (with
    `max_grad_norm` in place of theirs: LomoTrainer turns the Trainer's own clipping off)."""
    options = parse_optim_args(_parse_optim_args(args.optim_args))
    if max_grad_norm and not options.get("single_backward"):
        logger.info(
            "max_grad_norm=%s: exact clipping runs a norm pass, two backward passes per step; "
            "optim_args='single_backward=True' clips within one",
            max_grad_norm,
        )
    steps = args.gradient_accumulation_steps
    return {
        **({"accumulation_steps": steps} if steps > 1 else {}),
        "lr": args.learning_rate,
        "clip_grad_norm": max_grad_norm if max_grad_norm else None,
        "weight_decay": args.weight_decay,
        "param_groups": decay_param_groups(model, decay_names, args.weight_decay),
        **options,
    }
