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


def enable_trl() -> None:
    """`enable_transformers()`, and TRL's SFTTrainer keeps the forward of a model patched by
    `patch_causal_lm` (module docstring). Idempotent; `disable_trl()` undoes both."""
    from trl.trainer import sft_trainer

    enable_transformers()
    _patch(sft_trainer, "add_fused_lm_head", _keeping_patched_head(sft_trainer.add_fused_lm_head))


def disable_trl() -> None:
    """Undoes `enable_trl()` (and `enable_transformers()`)."""
    disable_transformers()
