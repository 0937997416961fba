"""The fused LOMO ops: their schemas (torch.library) and public functions.

    fused_sgd_update_     one LOMO/SGD step on one parameter, one pass over memory
                          (op ``lomo_kernels::sgd_update_``)
    grad_sumsq_           sum of squares of a (scaled) gradient + inf/nan flag, one pass
                          (op ``lomo_kernels::grad_sumsq_``)
    clip_coef_from_sumsq  device-side clip-by-norm coefficient

The public functions check their arguments and convert runtime scalars to device tensors
once (`scalars.py`); the ops take them only as tensors. Kernels per device: `backends.py`.
"""

from __future__ import annotations

import torch

from . import sgd_reference
from .backends import SGD, register_kernels, requested_backend
from .checks import check_finite, check_pair, check_scalar_tensor
from .scalars import Scalar, device_scalar, grad_transform, optional_factor


@torch.library.custom_op("lomo_kernels::sgd_update_", mutates_args=("param", "found_inf"))
def _sgd_update_op(
    param: torch.Tensor,
    grad: torch.Tensor,
    lr: torch.Tensor,
    inv_scale: torch.Tensor | None,
    clip_value: float | None,
    clip_coef: torch.Tensor | None,
    weight_decay: float,
    found_inf: torch.Tensor | None,
    skip_if: torch.Tensor | None,
    stochastic_rounding: bool,
    seed: int,
    seed_step: torch.Tensor | None,
    backend: str,
) -> None:
    sgd_reference.sgd_update_(
        param,
        grad,
        lr,
        inv_scale,
        clip_value,
        clip_coef,
        weight_decay,
        found_inf,
        skip_if,
        stochastic_rounding,
        seed,
        seed_step,
    )


# The op as callers use it: eager calls skip the dispatcher's Python layers (eager.py).
sgd_update_op = register_kernels(_sgd_update_op, SGD, "sgd_update_")


@torch.library.custom_op("lomo_kernels::grad_sumsq_", mutates_args=("sumsq", "found_inf"))
def _grad_sumsq_op(
    grad: torch.Tensor,
    inv_scale: torch.Tensor | None,
    sumsq: torch.Tensor,
    found_inf: torch.Tensor | None,
    backend: str,
) -> None:
    sgd_reference.grad_sumsq_(grad, inv_scale, sumsq, found_inf)


grad_sumsq_op = register_kernels(_grad_sumsq_op, SGD, "grad_sumsq_")


def fused_sgd_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    *,
    lr: Scalar,
    inv_scale: Scalar | None = 1.0,
    clip_value: float | None = None,
    clip_coef: Scalar | None = None,
    weight_decay: float = 0.0,
    found_inf: torch.Tensor | None = None,
    skip_if: torch.Tensor | None = None,
    stochastic_rounding: bool = False,
    seed: int = 0,
    seed_step: torch.Tensor | None = None,
    backend: str | None = None,
) -> None:
    """Applies one LOMO step to `param` in place, reading `grad` and `param` once.

    In fp32: ``g = grad * inv_scale``; an element whose ``g`` is inf/nan keeps its parameter
    value and sets ``found_inf``; ``g = clamp(g, -clip_value, clip_value)``;
    ``g *= clip_coef``; ``param = param * (1 - lr * weight_decay) - lr * g``, written back in
    the parameter's dtype (bf16/fp16 round to nearest even, or stochastically for bf16 with
    ``stochastic_rounding=True``, reproducible from ``seed`` and the element index).

    ``seed_step`` (optional, a 1-element int64 tensor on the parameter's device) is the
    per-step part of the rounding seed, read by the kernel: its low 32 bits are XORed into
    the high 32 bits of ``seed``. A training loop keeps ``seed`` fixed per parameter and
    refreshes ``seed_step`` in place each step, so a compiled graph never depends on the step.

    ``found_inf`` (1-element fp32) is only ever raised to 1. When ``skip_if`` is given and
    non-zero on entry the op writes nothing: pass the flag a detection pass filled. If
    ``skip_if`` is omitted, ``found_inf``'s own value on entry acts as the skip flag.
    """
    check_pair(param, grad)
    device = param.device
    lr_t = device_scalar("lr", lr, device, non_negative=True)
    transform = grad_transform(inv_scale, clip_value, clip_coef, device)
    check_finite("weight_decay", weight_decay)
    check_scalar_tensor("found_inf", found_inf, device)
    check_scalar_tensor("skip_if", skip_if, device)
    check_scalar_tensor("seed_step", seed_step, device, dtype=torch.int64)
    if stochastic_rounding and param.dtype != torch.bfloat16:
        raise ValueError(
            f"lomo_kernels: stochastic_rounding applies to bfloat16 parameters, got {param.dtype}"
        )
    if not 0 <= int(seed) < 2**63:
        raise ValueError(f"lomo_kernels: seed must be in [0, 2**63), got {seed}")
    if param.numel() == 0:
        return
    # Without an explicit skip flag, found_inf's value on entry decides (GradScaler pattern).
    sgd_update_op(
        param,
        grad.contiguous(),
        lr_t,
        *transform,
        float(weight_decay),
        found_inf,
        found_inf if skip_if is None else skip_if,
        bool(stochastic_rounding),
        int(seed),
        seed_step,
        requested_backend(backend),
    )


def grad_sumsq_(
    grad: torch.Tensor,
    sumsq: torch.Tensor,
    *,
    inv_scale: Scalar | None = 1.0,
    found_inf: torch.Tensor | None = None,
    backend: str | None = None,
) -> None:
    """``sumsq += sum((fp32(grad) * inv_scale) ** 2)``; raises ``found_inf`` to 1 on inf/nan.

    One pass over ``grad``; ``sumsq`` and ``found_inf`` are 1-element fp32 device tensors.
    """
    check_pair(grad, grad)
    check_scalar_tensor("sumsq", sumsq, grad.device)
    check_scalar_tensor("found_inf", found_inf, grad.device)
    inv_t = optional_factor("inv_scale", inv_scale, grad.device)
    if grad.numel() == 0:
        return
    grad_sumsq_op(grad.contiguous(), inv_t, sumsq, found_inf, requested_backend(backend))


def clip_coef_from_sumsq(sumsq: torch.Tensor, max_norm: float, eps: float = 1e-6) -> torch.Tensor:
    """``min(1, max_norm / (sqrt(sumsq) + eps))`` as a 1-element device tensor (no host sync)."""
    check_finite("max_norm", max_norm, positive=True)
    return torch.clamp(max_norm / (sumsq.sqrt() + eps), max=1.0)
