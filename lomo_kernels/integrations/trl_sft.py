"""TRL's trainers with this package's optimizers and logits-free head.

    import lomo_kernels
    lomo_kernels.enable_trl()                  # enable_transformers(), and the lines below
    model = lomo_kernels.patch_causal_lm(model)  # before or after building the trainer
    SFTTrainer(model=model, args=SFTConfig(..., optim="lomo"), ...).train()
    # DPOTrainer, GRPOTrainer, RLOOTrainer alike

SFTTrainer, DPOTrainer, GRPOTrainer and RLOOTrainer install TRL's chunked head over
``model.forward`` (``add_fused_lm_head(model, temperature, outputs=...)``) and ask the model
for per-token log-probabilities with ``fused_lm_head=True``; that head
(``ChunkedLogProbFunction``) reads the head weight and forms its gradient the ordinary way. A
model patched by `patch_causal_lm` answers ``fused_lm_head=True`` itself, through the fused
loss (`causal_lm.py`): after `enable_trl()` the trainers keep a patched model's forward
instead of wrapping it, and the temperature and per-token statistics they ask for are
recorded on it (`causal_lm.set_fused_head`): GRPO's and RLOO's temperature divides the logits
inside the kernels' blocks; the entropy, token accuracy, mean logits and ``log(sum p^2)``
come from the fused head's statistics pass (`token_metrics.py`). A reference model TRL scores
(DPO's ``ref_model``, GRPO's/RLOO's with ``beta > 0``) is patched too when the policy is, so
its log-probs are logits-free as well. A model patched after the trainer was built needs
`set_fused_head` to get anything but temperature 1 (the patched forward replaces TRL's).

What the fused head does not compute is refused by name when the trainer is built, before any
change: the gradient of GRPO's entropy (``entropy_coef != 0`` or ``use_adaptive_entropy``:
the fused head's entropy has no gradient), ``cast_lm_head_to_fp32`` (it replaces the head's
forward), a reference model of an architecture `patch_causal_lm` refuses.

Without `enable_trl()`, a model patched before the trainer was built is wrapped by TRL's head;
Lomo and AdaLomo then refuse the first step, before any change (`optim/head_guard.py`).

DPOTrainer, GRPOTrainer and RLOOTrainer run with Lomo/AdaLomo and
``gradient_accumulation_steps > 1`` through transformers' path (`huggingface.py`): their
losses go through ``accelerator.backward`` like SFT's. Every other trainer TRL defines is
refused with Lomo/AdaLomo by name when it builds its optimizer (`trl_trainers.py`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ..optim.head_guard import is_patched
from .causal_lm import patch_causal_lm, set_fused_head
from .huggingface import _patch, disable_transformers, enable_transformers

# What a trainer asked TRL's head for, recorded on a model TRL's head serves (a reference
# model patched later answers with it).
_REQUEST = "_lomo_kernels_trl_head_request"
# TRL's modules that import add_fused_lm_head by name.
_HEAD_MODULES = ("sft_trainer", "dpo_trainer", "grpo_trainer", "rloo_trainer")
# TRL trainers whose log-probs a patched model serves (SFTTrainer has no reference model).
_SERVED_TRAINERS = ("DPOTrainer", "GRPOTrainer", "RLOOTrainer")


def _keeping_patched_head(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def add_fused_lm_head(
        model: Any,
        temperature: float = 1.0,
        cast_lm_head_to_fp32: bool = False,
        outputs: tuple[str, ...] = ("log_probs",),
    ) -> Any:
        if not is_patched(model):
            setattr(model, _REQUEST, (temperature, tuple(outputs)))
            return original(model, temperature, cast_lm_head_to_fp32, outputs)
        if cast_lm_head_to_fp32:
            raise ValueError(
                "lomo_kernels: cast_lm_head_to_fp32=True replaces the head's forward, which "
                "patch_causal_lm made logits-free (the fused head accumulates its logits in "
                "fp32 already): set cast_lm_head_to_fp32=False, or train this model "
                "unpatched (lomo_kernels.unpatch_causal_lm). Nothing was changed."
            )
        set_fused_head(model, temperature, tuple(outputs))
        return None  # the patched forward serves fused_lm_head=True itself

    return add_fused_lm_head


def _entropy_gradient_refusal(trainer: Any) -> str:
    args = trainer.args
    if getattr(args, "entropy_coef", 0.0) or getattr(args, "use_adaptive_entropy", False):
        return (
            f"{type(trainer).__name__} with entropy_coef={args.entropy_coef} / "
            f"use_adaptive_entropy={args.use_adaptive_entropy} differentiates the entropy, "
            "and the fused head's entropy has no gradient: set entropy_coef=0 and "
            "use_adaptive_entropy=False, or train this model unpatched "
            "(lomo_kernels.unpatch_causal_lm(model))"
        )
    return ""


def serve_trainer(trainer: Any) -> None:
    """For a TRL trainer built around a model patched by `patch_causal_lm`: refuses by name
    what the fused head does not compute, and patches the reference model TRL scores, with
    the temperature and statistics the trainer asked for (module docstring)."""
    policy = trainer.accelerator.unwrap_model(trainer.model)
    if hasattr(policy, "get_base_model"):  # PEFT
        policy = policy.get_base_model()
    if not is_patched(policy):
        return
    reason = _entropy_gradient_refusal(trainer)
    if reason:
        raise ValueError(f"lomo_kernels: {reason}. Nothing was changed.")
    ref = getattr(trainer, "ref_model", None)
    if ref is None:
        return
    ref = trainer.accelerator.unwrap_model(ref)
    if not is_patched(ref):
        try:
            patch_causal_lm(ref)
        except ValueError as error:
            raise ValueError(
                f"lomo_kernels: {type(trainer).__name__}'s reference model cannot be scored by "
                f"the fused head ({error}); pass a reference model of the policy's "
                "architecture, or train the policy unpatched. Nothing was changed."
            ) from None
        set_fused_head(ref, *getattr(ref, _REQUEST, (1.0, ("log_probs",))))


def _serving_init(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        serve_trainer(self)

    return __init__


def enable_trl() -> None:
    """`enable_transformers()`, and TRL's SFT, DPO, GRPO and RLOO trainers keep the forward of
    a model patched by `patch_causal_lm` (module docstring). Idempotent; `disable_trl()`
    undoes both."""
    import importlib

    import trl

    enable_transformers()
    for name in _HEAD_MODULES:
        module = importlib.import_module(f"trl.trainer.{name}")
        _patch(module, "add_fused_lm_head", _keeping_patched_head(module.add_fused_lm_head))
    for name in _SERVED_TRAINERS:
        cls = getattr(trl, name)
        _patch(cls, "__init__", _serving_init(cls.__init__))


def disable_trl() -> None:
    """Undoes `enable_trl()` (and `enable_transformers()`)."""
    disable_transformers()
