"""Triton backend: the fused ops of reference.py as single-pass Triton kernels.

Same signatures and semantics as `reference.py`. Runs on CUDA devices, or on CPU tensors
under the Triton interpreter (TRITON_INTERPRET=1). Importing this module never fails: the
kernels are imported on first use, and `is_available()` says whether they can run.
"""

from __future__ import annotations

import torch


def unavailable_reason() -> str:
    """Why this backend cannot run here, or "" when it can."""
    try:
        from ..triton_kernels.sgd_update import interpret_mode
    except Exception as exc:  # triton missing or broken: fall back, never fail the import
        return f"triton is not importable: {exc!r}"
    if torch.cuda.is_available() or interpret_mode():
        return ""
    return "no CUDA device and TRITON_INTERPRET is not 1"


def is_available() -> bool:
    """True when triton imports and either CUDA is available or TRITON_INTERPRET=1."""
    return unavailable_reason() == ""


def sgd_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    *,
    lr: float,
    lr_tensor: torch.Tensor | None,
    inv_scale: float,
    inv_scale_tensor: torch.Tensor | None,
    clip_value: float | None,
    clip_coef: float,
    clip_coef_tensor: torch.Tensor | None,
    weight_decay: float,
    found_inf: torch.Tensor | None,
    skip_if: torch.Tensor | None,
    stochastic_rounding: bool,
    seed: int,
) -> None:
    """One LOMO step on one contiguous parameter, in place, in one kernel launch.

    See `reference.sgd_update_`. No host synchronisation: tensor-valued scalars are read on
    the device, and skip_if suppresses every write on the device.
    """
    from ..triton_kernels.sgd_update import sgd_update

    sgd_update(
        param,
        grad,
        lr=lr,
        lr_tensor=lr_tensor,
        inv_scale=inv_scale,
        inv_scale_tensor=inv_scale_tensor,
        clip_value=clip_value,
        clip_coef=clip_coef,
        clip_coef_tensor=clip_coef_tensor,
        weight_decay=weight_decay,
        found_inf=found_inf,
        skip_if=skip_if,
        stochastic_rounding=stochastic_rounding,
        seed=seed,
    )


def grad_sumsq_(
    grad: torch.Tensor,
    *,
    inv_scale: float,
    inv_scale_tensor: torch.Tensor | None,
    sumsq: torch.Tensor,
    found_inf: torch.Tensor | None,
) -> None:
    """sumsq += sum((fp32(grad) * inv_scale) ** 2); found_inf = 1 if any element is inf/nan.

    See `reference.grad_sumsq_`; partial sums are added atomically, so the summation order
    (and the last bits of sumsq) differ from torch.dot.
    """
    from ..triton_kernels.sgd_update import grad_sumsq

    grad_sumsq(
        grad,
        inv_scale=inv_scale,
        inv_scale_tensor=inv_scale_tensor,
        sumsq=sumsq,
        found_inf=found_inf,
    )
