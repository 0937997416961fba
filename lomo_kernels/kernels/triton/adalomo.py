"""Triton launchers of the AdaLomo passes (kernels: `adalomo_kernels.py`).

Same arguments and semantics as `lomo_kernels.ops.adalomo_reference`.

Runs on CUDA tensors, or on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1).
Importing this module never fails; the kernels are imported on first use. Each function is
one kernel launch and never reads a device value on the host.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import torch

from .runtime import (
    KIND,
    is_available,
    kernels,
    on_first_argument_device,
    rounding_args,
    storage,
    unavailable_reason,
)

__all__ = [
    "factored_apply_",
    "factored_moments_",
    "factored_norm_",
    "factored_stats_",
    "is_available",
    "unavailable_reason",
    "vector_apply_",
    "vector_stats_",
]

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


def _scaled_kwargs(
    grad: torch.Tensor, inv_scale: torch.Tensor | None, clip_value: float | None
) -> dict[str, Any]:
    """The gradient arguments of pass A, which applies no clip coefficient."""
    return {
        "grad_ptr": storage(grad),
        "inv_scale_ptr": inv_scale,
        "clip_value": 0.0 if clip_value is None else float(clip_value),
        "GRAD_KIND": KIND[grad.dtype],
        "HAS_CLIP_VALUE": clip_value is not None,
    }


def _grad_kwargs(
    grad: torch.Tensor,
    inv_scale: torch.Tensor | None,
    clip_value: float | None,
    clip_coef: torch.Tensor | None,
) -> dict[str, Any]:
    return {
        **_scaled_kwargs(grad, inv_scale, clip_value),
        "clip_coef_ptr": clip_coef,
        "HAS_CLIP_COEF": clip_coef is not None,
    }


def _step_kwargs(
    numel: int, lr: torch.Tensor, eps1: float, clip_threshold: float, weight_decay: float
) -> dict[str, Any]:
    return {
        "numel_f": float(numel),
        "lr_ptr": lr,
        "eps1": float(eps1),
        "clip_threshold": float(clip_threshold),
        "weight_decay": float(weight_decay),
    }


def _rounding_kwargs(
    param: torch.Tensor, stochastic_rounding: bool, seed: int, seed_step: torch.Tensor | None
) -> dict[str, Any]:
    """The write-back's rounding arguments, as the LOMO update's (`lomo.lomo_update_args`):
    stochastic for bf16 and fp16 parameters when asked, the per-step value read on the
    device."""
    stochastic, seed_lo, seed_hi = rounding_args(param, stochastic_rounding, seed)
    return {
        "seed_lo": seed_lo,
        "seed_hi": seed_hi,
        "seed_step_ptr": seed_step if stochastic else None,
        "STOCHASTIC_ROUNDING": stochastic,
    }


def _vector_launch(
    param: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    workspace: torch.Tensor,
    beta2: torch.Tensor,
    eps0: float,
) -> tuple[tuple[int], dict[str, Any]]:
    """(grid, arguments) both 1-D passes take: the tensors, their size and beta2, eps0."""
    n = param.numel()
    return (-(-n // VECTOR_BLOCK),), {
        "param_ptr": storage(param),
        "v_ptr": exp_avg_sq,
        "ws_ptr": workspace,
        "n": n,
        "beta2_ptr": beta2,
        "eps0": float(eps0),
        "PARAM_KIND": KIND[param.dtype],
        "BLOCK": VECTOR_BLOCK,
    }


def _kernels() -> ModuleType:
    return kernels("adalomo_kernels")


@on_first_argument_device
def factored_stats_(
    grad: torch.Tensor,
    param: torch.Tensor,
    workspace: torch.Tensor,
    found_inf: torch.Tensor | None,
    skip_if: torch.Tensor | None,
    cols: int,
    inv_scale: torch.Tensor | None,
    clip_value: float | None,
) -> None:
    """Pass A: row/column sums of g^2, sums of (grad * inv_scale)^2 and p^2, non-finite flag."""
    grid, sizes = _tiling(grad.numel() // cols, cols, grad.device)
    _kernels().factored_stats_kernel[grid](
        param_ptr=storage(param),
        ws_ptr=workspace,
        found_inf_ptr=found_inf,
        skip_if_ptr=skip_if,
        PARAM_KIND=KIND[param.dtype],
        **sizes,
        **_scaled_kwargs(grad, inv_scale, clip_value),
        num_warps=NUM_WARPS,
    )


@on_first_argument_device
def factored_moments_(
    exp_avg_sq_row: torch.Tensor,
    exp_avg_sq_col: torch.Tensor,
    workspace: torch.Tensor,
    beta2: torch.Tensor,
    clip_coef: torch.Tensor | None,
    eps0: float,
) -> None:
    """The row/column moments and sum(R)."""
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
        beta2,
        clip_coef,
        float(eps0),
        BLOCK=block,
        num_warps=4,
    )


@on_first_argument_device
def factored_norm_(
    grad: torch.Tensor,
    exp_avg_sq_row: torch.Tensor,
    exp_avg_sq_col: torch.Tensor,
    workspace: torch.Tensor,
    inv_scale: torch.Tensor | None,
    clip_value: float | None,
    clip_coef: torch.Tensor | None,
) -> None:
    """Pass B: sum of update^2."""
    grid, sizes = _tiling(exp_avg_sq_row.numel(), exp_avg_sq_col.numel(), grad.device)
    _kernels().factored_norm_kernel[grid](
        row_state_ptr=exp_avg_sq_row,
        col_state_ptr=exp_avg_sq_col,
        ws_ptr=workspace,
        **sizes,
        **_grad_kwargs(grad, inv_scale, clip_value, clip_coef),
        num_warps=NUM_WARPS,
    )


@on_first_argument_device
def factored_apply_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg_sq_row: torch.Tensor,
    exp_avg_sq_col: torch.Tensor,
    workspace: torch.Tensor,
    lr: torch.Tensor,
    eps1: float,
    clip_threshold: float,
    weight_decay: float,
    inv_scale: torch.Tensor | None,
    clip_value: float | None,
    clip_coef: torch.Tensor | None,
    stochastic_rounding: bool,
    seed: int,
    seed_step: torch.Tensor | None,
) -> None:
    """Pass C: the write-back."""
    grid, sizes = _tiling(exp_avg_sq_row.numel(), exp_avg_sq_col.numel(), param.device)
    _kernels().factored_apply_kernel[grid](
        param_ptr=storage(param),
        row_state_ptr=exp_avg_sq_row,
        col_state_ptr=exp_avg_sq_col,
        ws_ptr=workspace,
        PARAM_KIND=KIND[param.dtype],
        **sizes,
        **_step_kwargs(param.numel(), lr, eps1, clip_threshold, weight_decay),
        **_grad_kwargs(grad, inv_scale, clip_value, clip_coef),
        **_rounding_kwargs(param, stochastic_rounding, seed, seed_step),
        num_warps=NUM_WARPS,
    )


@on_first_argument_device
def vector_stats_(
    grad: torch.Tensor,
    param: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    workspace: torch.Tensor,
    found_inf: torch.Tensor | None,
    skip_if: torch.Tensor | None,
    beta2: torch.Tensor,
    eps0: float,
    inv_scale: torch.Tensor | None,
    clip_value: float | None,
    clip_coef: torch.Tensor | None,
) -> None:
    """Pass A1: sum of update^2 and of p^2 of a 1-D tensor."""
    grid, vector = _vector_launch(param, exp_avg_sq, workspace, beta2, eps0)
    _kernels().vector_stats_kernel[grid](
        found_inf_ptr=found_inf,
        skip_if_ptr=skip_if,
        **vector,
        **_grad_kwargs(grad, inv_scale, clip_value, clip_coef),
        num_warps=NUM_WARPS,
    )


@on_first_argument_device
def vector_apply_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    workspace: torch.Tensor,
    beta2: torch.Tensor,
    eps0: float,
    lr: torch.Tensor,
    eps1: float,
    clip_threshold: float,
    weight_decay: float,
    inv_scale: torch.Tensor | None,
    clip_value: float | None,
    clip_coef: torch.Tensor | None,
    stochastic_rounding: bool,
    seed: int,
    seed_step: torch.Tensor | None,
) -> None:
    """Pass C1: the write-back of a 1-D tensor and its second moment."""
    grid, vector = _vector_launch(param, exp_avg_sq, workspace, beta2, eps0)
    _kernels().vector_apply_kernel[grid](
        **vector,
        **_step_kwargs(param.numel(), lr, eps1, clip_threshold, weight_decay),
        **_grad_kwargs(grad, inv_scale, clip_value, clip_coef),
        **_rounding_kwargs(param, stochastic_rounding, seed, seed_step),
        num_warps=NUM_WARPS,
    )
