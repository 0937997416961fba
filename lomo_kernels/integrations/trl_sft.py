"""TRL's SFTTrainer with this package's optimizers and logits-free head.

    import lomo_kernels
    lomo_kernels.enable_trl()                  # enable_transformers(), and the line below
    model = lomo_kernels.patch_causal_lm(model)  # before or after building the trainer
    SFTTrainer(model=model, args=SFTConfig(..., optim="lomo"), ...).train()

SFTTrainer installs its own chunked head over ``model.forward`` (``add_fused_lm_head``) and
asks the model for per-token log-probabilities with ``fused_lm_head=True``; that head forms
the head's gradient the ordinary way. A model patched by `patch_causal_lm` answers
``fused_lm_head=True`` itself, through the fused loss (`causal_lm.py`), so after
`enable_trl()` the trainer keeps a patched model's forward instead of wrapping it. A model
patched after the trainer was built needs nothing: the patched forward replaces TRL's. The
entropy and token accuracy TRL logs come from the fused head (`token_metrics.py`).

Without `enable_trl()`, a model patched before the trainer was built is wrapped by TRL's head;
Lomo and AdaLomo then refuse the first step, before any change (`optim/head_guard.py`).
Only SFTTrainer keeps the patched head: TRL's other trainers ask the head for other values.

DPOTrainer, GRPOTrainer and RLOOTrainer run with Lomo/AdaLomo and
``gradient_accumulation_steps > 1`` through transformers' path (`huggingface.py`): their
losses go through ``accelerator.backward`` like SFT's. A model patched by `patch_causal_lm`
is refused by them when the trainer builds its optimizer, before any change: they compute
per-token log-probs through TRL's own chunked head (``ChunkedLogProbFunction``), which reads
the head weight, so the patch would save nothing. KTOTrainer and DistillationTrainer are
refused with Lomo/AdaLomo by name: their steps are not checked against torch's optimizers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..optim.head_guard import is_patched
from .huggingface import _patch, disable_transformers, enable_transformers


def _keeping_patched_head(original: Callable[..., Any]) -> Callable[..., Any]:
    def add_fused_lm_head(model: Any, *args: Any, **kwargs: Any) -> Any:
        if not is_patched(model):
            return original(model, *args, **kwargs)
        temperature = kwargs.get("temperature", args[0] if args else 1.0)
        if temperature != 1.0:
            raise ValueError(
                f"lomo_kernels: TRL asks the fused head for log-probabilities at temperature "
                f"{temperature}; the patched head computes them at 1.0: train this model "
                "unpatched (lomo_kernels.unpatch_causal_lm)"
            )
        return None  # the patched forward serves fused_lm_head=True itself

    add_fused_lm_head.__wrapped__ = original  # type: ignore[attr-defined]
    return add_fused_lm_head


# TRL trainers whose per-token log-probs come from TRL's chunked head (a patched model refused).
_OWN_HEAD_TRAINERS = ("DPOTrainer", "GRPOTrainer", "RLOOTrainer")
# TRL trainers not checked with Lomo/AdaLomo (refused by name).
_UNCHECKED_TRAINERS = ("KTOTrainer", "DistillationTrainer")


def check_trl_trainer(trainer: Any) -> None:
    """Refuses, before the optimizer is built, what a TRL trainer other than SFTTrainer
    cannot run with Lomo/AdaLomo (module docstring)."""
    optim = getattr(trainer.args.optim, "value", trainer.args.optim)  # an OptimizerNames
    if optim not in ("lomo", "adalomo"):
        return
    name = type(trainer).__name__
    for base in type(trainer).__mro__:
        if base.__name__ in _UNCHECKED_TRAINERS:
            raise ValueError(
                f"lomo_kernels: {name} (a {base.__name__}) with optim={optim!r}"
                " is not supported: its steps are not checked against torch's optimizers. "
                "Use DPOTrainer, GRPOTrainer, RLOOTrainer or SFTTrainer. Nothing was changed."
            )
        if base.__name__ in _OWN_HEAD_TRAINERS and is_patched(trainer.model):
            raise ValueError(
                f"lomo_kernels: {name} computes per-token log-probs through TRL's own chunked "
                "head (ChunkedLogProbFunction), which reads the head weight, so a model patched "
                "by patch_causal_lm would form the head's gradient the ordinary way: train "
                "this model unpatched (lomo_kernels.unpatch_causal_lm(model)); Lomo/AdaLomo "
                "and gradient accumulation still run. Nothing was changed."
            )


def _checked_create_optimizer(original: Callable[..., Any]) -> Callable[..., Any]:
    def create_optimizer(self: Any, *args: Any, **kwargs: Any) -> Any:
        check_trl_trainer(self)
        return original(self, *args, **kwargs)

    return create_optimizer


def enable_trl() -> None:
    """`enable_transformers()`, and TRL's SFTTrainer keeps the forward of a model patched by
    `patch_causal_lm` (module docstring). Idempotent; `disable_trl()` undoes both."""
    from trl.trainer import sft_trainer

    enable_transformers()
    _patch(sft_trainer, "add_fused_lm_head", _keeping_patched_head(sft_trainer.add_fused_lm_head))
    import trl

    for name in _OWN_HEAD_TRAINERS + _UNCHECKED_TRAINERS:
        cls = getattr(trl, name)
        _patch(cls, "create_optimizer", _checked_create_optimizer(cls.create_optimizer))


def disable_trl() -> None:
    """Undoes `enable_trl()` (and `enable_transformers()`)."""
    disable_transformers()
