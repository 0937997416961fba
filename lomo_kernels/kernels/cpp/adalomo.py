"""C++ (CPU) and CUDA backend of the AdaLomo passes: torch extensions built on first use.

Same signatures and semantics as `reference.py`. Nothing is built at import time; a failed
build is recorded and reported by `unavailable_reason`, never raised, so the dispatcher can
warn once and fall back. torch.utils.cpp_extension caches the build (keyed by the sources),
so later processes only load it.

CPU: `csrc/adalomo_cpu.cpp`. CUDA: `csrc/adalomo_cuda.cu` (kernels and `extern "C"`
launchers, buildable by nvcc alone) plus `csrc/adalomo_cuda_binding.cpp`, which needs a
CUDA build of torch.
"""

from __future__ import annotations

import torch

from .._extension import ExtensionLoader

_loader = ExtensionLoader(
    "AdaLomo C++ backend",
    cpu=("lomo_kernels_adalomo_cpu", ["adalomo_cpu.cpp"]),
    cuda=("lomo_kernels_adalomo_cuda", ["adalomo_cuda.cu", "adalomo_cuda_binding.cpp"]),
    native=False,
)
is_available = _loader.is_available
unavailable_reason = _loader.unavailable_reason
_module = _loader.module


def _opt(value: float | None) -> float | None:
    return None if value is None else float(value)


def factored_stats_(
    grad: torch.Tensor,
    param: torch.Tensor,
    workspace: torch.Tensor,
    found_inf: torch.Tensor | None,
    skip_if: torch.Tensor | None,
    *,
    cols: int,
    inv_scale: float,
    inv_scale_tensor: torch.Tensor | None,
    clip_value: float | None,
    clip_coef: float,
    clip_coef_tensor: torch.Tensor | None,
    eps0: float,
) -> None:
    """Pass A (see `reference.factored_stats_`)."""
    _module(grad.device.type).factored_stats_(
        grad,
        param,
        workspace,
        found_inf,
        skip_if,
        int(cols),
        float(inv_scale),
        inv_scale_tensor,
        _opt(clip_value),
        float(clip_coef),
        clip_coef_tensor,
        float(eps0),
    )


def factored_moments_(
    exp_avg_sq_row: torch.Tensor,
    exp_avg_sq_col: torch.Tensor,
    workspace: torch.Tensor,
    *,
    beta2: float,
    beta2_tensor: torch.Tensor | None,
) -> None:
    """Row/column moments and sum(R) (see `reference.factored_moments_`)."""
    _module(workspace.device.type).factored_moments_(
        exp_avg_sq_row, exp_avg_sq_col, workspace, float(beta2), beta2_tensor
    )


def factored_norm_(
    grad: torch.Tensor,
    exp_avg_sq_row: torch.Tensor,
    exp_avg_sq_col: torch.Tensor,
    workspace: torch.Tensor,
    *,
    inv_scale: float,
    inv_scale_tensor: torch.Tensor | None,
    clip_value: float | None,
    clip_coef: float,
    clip_coef_tensor: torch.Tensor | None,
) -> None:
    """Pass B (see `reference.factored_norm_`)."""
    _module(grad.device.type).factored_norm_(
        grad,
        exp_avg_sq_row,
        exp_avg_sq_col,
        workspace,
        float(inv_scale),
        inv_scale_tensor,
        _opt(clip_value),
        float(clip_coef),
        clip_coef_tensor,
    )


def factored_apply_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg_sq_row: torch.Tensor,
    exp_avg_sq_col: torch.Tensor,
    workspace: torch.Tensor,
    *,
    lr: float,
    lr_tensor: torch.Tensor | None,
    eps1: float,
    clip_threshold: float,
    weight_decay: float,
    inv_scale: float,
    inv_scale_tensor: torch.Tensor | None,
    clip_value: float | None,
    clip_coef: float,
    clip_coef_tensor: torch.Tensor | None,
) -> None:
    """Pass C (see `reference.factored_apply_`)."""
    _module(param.device.type).factored_apply_(
        param,
        grad,
        exp_avg_sq_row,
        exp_avg_sq_col,
        workspace,
        float(lr),
        lr_tensor,
        float(eps1),
        float(clip_threshold),
        float(weight_decay),
        float(inv_scale),
        inv_scale_tensor,
        _opt(clip_value),
        float(clip_coef),
        clip_coef_tensor,
    )


def vector_stats_(
    grad: torch.Tensor,
    param: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    workspace: torch.Tensor,
    found_inf: torch.Tensor | None,
    skip_if: torch.Tensor | None,
    *,
    beta2: float,
    beta2_tensor: torch.Tensor | None,
    eps0: float,
    inv_scale: float,
    inv_scale_tensor: torch.Tensor | None,
    clip_value: float | None,
    clip_coef: float,
    clip_coef_tensor: torch.Tensor | None,
) -> None:
    """Pass A1 (see `reference.vector_stats_`)."""
    _module(grad.device.type).vector_stats_(
        grad,
        param,
        exp_avg_sq,
        workspace,
        found_inf,
        skip_if,
        float(beta2),
        beta2_tensor,
        float(eps0),
        float(inv_scale),
        inv_scale_tensor,
        _opt(clip_value),
        float(clip_coef),
        clip_coef_tensor,
    )


def vector_apply_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    workspace: torch.Tensor,
    *,
    beta2: float,
    beta2_tensor: torch.Tensor | None,
    eps0: float,
    lr: float,
    lr_tensor: torch.Tensor | None,
    eps1: float,
    clip_threshold: float,
    weight_decay: float,
    inv_scale: float,
    inv_scale_tensor: torch.Tensor | None,
    clip_value: float | None,
    clip_coef: float,
    clip_coef_tensor: torch.Tensor | None,
) -> None:
    """Pass C1 (see `reference.vector_apply_`)."""
    _module(param.device.type).vector_apply_(
        param,
        grad,
        exp_avg_sq,
        workspace,
        float(beta2),
        beta2_tensor,
        float(eps0),
        float(lr),
        lr_tensor,
        float(eps1),
        float(clip_threshold),
        float(weight_decay),
        float(inv_scale),
        inv_scale_tensor,
        _opt(clip_value),
        float(clip_coef),
        clip_coef_tensor,
    )
