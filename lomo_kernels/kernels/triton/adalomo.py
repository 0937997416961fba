"""Triton backend of the AdaLomo passes: same signatures and semantics as `reference.py`.

Runs on CUDA tensors, or on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1).
Importing this module never fails; the kernels are imported on first use. Each function is
one kernel launch and never reads a device value on the host.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from types import ModuleType
from typing import Any

import torch

# Elements per program of the 1-D passes (16 per thread with 8 warps).
VECTOR_BLOCK = 4096
NUM_WARPS = 8
# Elements per tile of the factored passes; BLOCK_N columns wide, at most 256 so a row
# segment is 1 KiB of fp32 (coalesced) and a tile keeps 16 values per thread.
TILE = 4096
MAX_BLOCK_N = 256
# Programs per SM the factored passes aim for on a GPU (enough to hide memory latency; more
# would only add atomics on the column sums).
PROGRAMS_PER_SM = 8
# Under the interpreter every program, loop iteration and nested jit call costs fixed Python
# overhead while numpy handles large tiles cheaply: fewer, bigger tiles, one row group.
INTERPRETER_TILE = 1 << 17
INTERPRETER_MAX_BLOCK_N = 4096
INTERPRETER_PROGRAMS = 1

_KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _kernels() -> ModuleType:
    """The kernels module, re-decorated if TRITON_INTERPRET changed since its import."""
    from . import triton_kernels

    if triton_kernels.interpret_mode() != triton_kernels.DECORATED_FOR_INTERPRETER:
        triton_kernels = importlib.reload(sys.modules[triton_kernels.__name__])
    return triton_kernels


def interpret_mode() -> bool:
    """True when Triton runs kernels in its CPU interpreter."""
    try:
        return _kernels().interpret_mode()
    except Exception:  # triton missing or broken
        return os.environ.get("TRITON_INTERPRET", "0") == "1"


def unavailable_reason() -> str:
    """Why this backend cannot run here, or "" when it can."""
    try:
        kernels = _kernels()
    except Exception as exc:  # a missing or broken triton must never fail an import
        return f"triton is not importable: {exc!r}"
    if torch.cuda.is_available() or kernels.interpret_mode():
        return ""
    return "no CUDA device and TRITON_INTERPRET is not 1"


def is_available() -> bool:
    """True when triton imports and either CUDA is available or TRITON_INTERPRET=1."""
    return unavailable_reason() == ""


def _storage(t: torch.Tensor) -> torch.Tensor:
    """The tensor the kernels address: bf16 as its int16 bit patterns."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _tiling(rows: int, cols: int, device: torch.device) -> tuple[tuple[int, int], dict[str, int]]:
    """(grid, launch sizes) of the factored passes for a [rows, cols] tensor."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        tile, max_block_n, programs = TILE, MAX_BLOCK_N, PROGRAMS_PER_SM * _sm_count(index)
    else:
        tile, max_block_n, programs = (
            INTERPRETER_TILE,
            INTERPRETER_MAX_BLOCK_N,
            INTERPRETER_PROGRAMS,
        )
    block_n = min(max(_next_pow2(cols), 16), max_block_n)
    block_m = min(max(tile // block_n, 1), _next_pow2(rows))
    col_blocks = -(-cols // block_n)
    row_groups = max(1, min(-(-rows // block_m), programs // col_blocks))
    rows_per_prog = -(-rows // row_groups)
    rows_per_prog = -(-rows_per_prog // block_m) * block_m
    grid = (col_blocks, -(-rows // rows_per_prog))
    return grid, {
        "rows": rows,
        "cols": cols,
        "rows_per_prog": rows_per_prog,
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
    }


def _grad_kwargs(
    grad: torch.Tensor,
    inv_scale: float,
    inv_scale_tensor: torch.Tensor | None,
    clip_value: float | None,
    clip_coef: float,
    clip_coef_tensor: torch.Tensor | None,
) -> dict[str, Any]:
    return {
        "grad_ptr": _storage(grad),
        "inv_scale": float(inv_scale),
        "inv_scale_tensor_ptr": inv_scale_tensor,
        "clip_value": 0.0 if clip_value is None else float(clip_value),
        "clip_coef": float(clip_coef),
        "clip_coef_tensor_ptr": clip_coef_tensor,
        "GRAD_KIND": _KIND[grad.dtype],
        "HAS_CLIP_VALUE": clip_value is not None,
        "HAS_CLIP_COEF": clip_coef_tensor is not None or clip_coef != 1.0,
    }


def _beta_kwargs(beta2: float, beta2_tensor: torch.Tensor | None) -> dict[str, Any]:
    # 1 - beta2 in double on the host, as the reference's Python arithmetic does.
    return {
        "beta2": float(beta2),
        "one_minus_beta2": 1.0 - float(beta2),
        "beta2_tensor_ptr": beta2_tensor,
    }


def _step_kwargs(
    numel: int,
    lr: float,
    lr_tensor: torch.Tensor | None,
    eps1: float,
    clip_threshold: float,
    weight_decay: float,
) -> dict[str, Any]:
    return {
        "numel_f": float(numel),
        "lr": float(lr),
        "lr_tensor_ptr": lr_tensor,
        "eps1": float(eps1),
        "clip_threshold": float(clip_threshold),
        "weight_decay": float(weight_decay),
    }


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
    grid, sizes = _tiling(grad.numel() // cols, cols, grad.device)
    _kernels().factored_stats_kernel[grid](
        param_ptr=_storage(param),
        ws_ptr=workspace,
        found_inf_ptr=found_inf,
        skip_if_ptr=skip_if,
        eps0=float(eps0),
        PARAM_KIND=_KIND[param.dtype],
        **sizes,
        **_grad_kwargs(grad, inv_scale, inv_scale_tensor, clip_value, clip_coef, clip_coef_tensor),
        num_warps=NUM_WARPS,
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
    rows, cols = exp_avg_sq_row.numel(), exp_avg_sq_col.numel()
    block = 1024
    n_row_blocks = -(-rows // block)
    grid = (n_row_blocks + -(-cols // block),)
    _kernels().factored_moments_kernel[grid](
        exp_avg_sq_row,
        exp_avg_sq_col,
        workspace,
        rows,
        cols,
        n_row_blocks,
        **_beta_kwargs(beta2, beta2_tensor),
        BLOCK=block,
        num_warps=4,
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
    grid, sizes = _tiling(exp_avg_sq_row.numel(), exp_avg_sq_col.numel(), grad.device)
    _kernels().factored_norm_kernel[grid](
        row_state_ptr=exp_avg_sq_row,
        col_state_ptr=exp_avg_sq_col,
        ws_ptr=workspace,
        **sizes,
        **_grad_kwargs(grad, inv_scale, inv_scale_tensor, clip_value, clip_coef, clip_coef_tensor),
        num_warps=NUM_WARPS,
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
    grid, sizes = _tiling(exp_avg_sq_row.numel(), exp_avg_sq_col.numel(), param.device)
    _kernels().factored_apply_kernel[grid](
        param_ptr=_storage(param),
        row_state_ptr=exp_avg_sq_row,
        col_state_ptr=exp_avg_sq_col,
        ws_ptr=workspace,
        PARAM_KIND=_KIND[param.dtype],
        **sizes,
        **_step_kwargs(param.numel(), lr, lr_tensor, eps1, clip_threshold, weight_decay),
        **_grad_kwargs(grad, inv_scale, inv_scale_tensor, clip_value, clip_coef, clip_coef_tensor),
        num_warps=NUM_WARPS,
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
    n = param.numel()
    _kernels().vector_stats_kernel[(-(-n // VECTOR_BLOCK),)](
        param_ptr=_storage(param),
        v_ptr=exp_avg_sq,
        ws_ptr=workspace,
        found_inf_ptr=found_inf,
        skip_if_ptr=skip_if,
        n=n,
        eps0=float(eps0),
        PARAM_KIND=_KIND[param.dtype],
        BLOCK=VECTOR_BLOCK,
        **_beta_kwargs(beta2, beta2_tensor),
        **_grad_kwargs(grad, inv_scale, inv_scale_tensor, clip_value, clip_coef, clip_coef_tensor),
        num_warps=NUM_WARPS,
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
    n = param.numel()
    _kernels().vector_apply_kernel[(-(-n // VECTOR_BLOCK),)](
        param_ptr=_storage(param),
        v_ptr=exp_avg_sq,
        ws_ptr=workspace,
        n=n,
        eps0=float(eps0),
        PARAM_KIND=_KIND[param.dtype],
        BLOCK=VECTOR_BLOCK,
        **_beta_kwargs(beta2, beta2_tensor),
        **_step_kwargs(n, lr, lr_tensor, eps1, clip_threshold, weight_decay),
        **_grad_kwargs(grad, inv_scale, inv_scale_tensor, clip_value, clip_coef, clip_coef_tensor),
        num_warps=NUM_WARPS,
    )
