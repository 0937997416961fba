"""Triton launchers of the AdaLomo passes (kernels: `adalomo_kernels.py`).

Same arguments and semantics as `lomo_kernels.ops.adalomo.reference`.

Runs on CUDA tensors, or on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1).
Importing this module never fails; the kernels are imported on first use. Each function is
one kernel launch and never reads a device value on the host.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import torch

from ...kernels.triton import runtime
from ...kernels.triton.runtime import is_available, unavailable_reason  # the backend interface
from .spec import (
    FACTORED_APPLY,
    FACTORED_MOMENTS,
    FACTORED_NORM,
    FACTORED_STATS,
    VECTOR_APPLY,
    VECTOR_STATS,
)
from .workspace import NUM_SLOTS

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
# The moments pass: elements of R or C per program, and its warps.
MOMENTS_BLOCK = 1024
MOMENTS_NUM_WARPS = 4


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
    col_blocks = runtime.cdiv(cols, block_n)
    row_groups = max(1, min(runtime.cdiv(rows, block_m), programs // col_blocks))
    rows_per_prog = runtime.cdiv(rows, row_groups)
    rows_per_prog = runtime.cdiv(rows_per_prog, block_m) * block_m
    grid = (col_blocks, runtime.cdiv(rows, rows_per_prog))
    return grid, {
        "rows": rows,
        "cols": cols,
        "rows_per_prog": rows_per_prog,
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
    }


def _slice_tiling(
    rows: int, cols: int, offset: int, n: int, device: torch.device
) -> runtime.Launch:
    """(grid, launch sizes) of a factored pass over the flat elements [offset, offset + n) of
    a [rows, cols] matrix, tiling the rows they touch."""
    touched = runtime.cdiv(offset + n, cols) - offset // cols
    grid, sizes = _tiling(touched, cols, device)
    return grid, {**sizes, "rows": rows, "offset": offset, "n": n}


def _update_launch(a: Any, device: torch.device) -> runtime.Launch:
    """(grid, arguments) both factored update passes (B, C) take: the moments, the workspace,
    the slice of their [rows, cols] matrix that grad holds, and the tiling of the rows it
    touches."""
    rows, cols = a.exp_avg_sq_row.numel(), a.exp_avg_sq_col.numel()
    grid, sizes = _slice_tiling(rows, cols, a.offset, a.grad.numel(), device)
    return grid, {
        "row_state_ptr": a.exp_avg_sq_row,
        "col_state_ptr": a.exp_avg_sq_col,
        "ws_ptr": a.workspace,
        **sizes,
    }


def _vector_launch(a: Any) -> runtime.Launch:
    """(grid, arguments) both 1-D passes take: the tensors, their size and beta2, eps0."""
    n = a.param.numel()
    return (runtime.cdiv(n, VECTOR_BLOCK),), {
        **runtime.param_kwargs(a.param),
        "v_ptr": a.exp_avg_sq,
        "ws_ptr": a.workspace,
        "n": n,
        "beta2_ptr": a.beta2,
        "eps0": float(a.eps0),
        "BLOCK": VECTOR_BLOCK,
    }


def _grad_kwargs(a: Any) -> dict[str, Any]:
    """The gradient's arguments of every pass (`runtime.grad_kwargs`)."""
    return runtime.grad_kwargs(a.grad, a.inv_scale, a.clip_value)


def _clip_coef_kwargs(a: Any) -> dict[str, Any]:
    """The clip coefficient of the passes that apply it (all but pass A)."""
    return {"clip_coef_ptr": a.clip_coef, "HAS_CLIP_COEF": a.clip_coef is not None}


def _write_back_kwargs(a: Any, numel: int) -> dict[str, Any]:
    """The write-back's hyper-parameters and rounding (passes C, C1), rounded as the LOMO
    update's: stochastic for bf16 and fp16 parameters when asked, the per-step value read on
    the device; `numel`: the whole tensor's, of its rms values."""
    return {
        "numel_f": float(numel),
        "lr_ptr": a.lr,
        "eps1": float(a.eps1),
        "clip_threshold": float(a.clip_threshold),
        "weight_decay": float(a.weight_decay),
        **runtime.rounding_kwargs(a.param, a.stochastic_rounding, a.seed, a.seed_step),
    }


def _kernels() -> ModuleType:
    return runtime.kernels("adalomo_kernels")


# Each pass's grid and kernel arguments, from the op's arguments `a` (its spec's
# ``Arguments``: `spec.py`).
def factored_stats_args(a: Any) -> runtime.Launch:
    """Pass A: row/column sums of g^2, sums of (grad * inv_scale)^2 and p^2, non-finite flag,
    over the slice grad holds of the [rows, cols] matrix whose sums the workspace holds. No
    clip coefficient: the moments pass applies it."""
    rows = a.workspace.numel() - a.cols - NUM_SLOTS
    grid, sizes = _slice_tiling(rows, a.cols, a.offset, a.grad.numel(), a.grad.device)
    return grid, {
        **runtime.param_kwargs(a.param),
        "ws_ptr": a.workspace,
        "found_inf_ptr": a.found_inf,
        "skip_if_ptr": a.skip_if,
        **sizes,
        **_grad_kwargs(a),
    }


def factored_moments_args(a: Any) -> runtime.Launch:
    """The row/column moments and sum(R)."""
    rows, cols = a.exp_avg_sq_row.numel(), a.exp_avg_sq_col.numel()
    n_row_blocks = runtime.cdiv(rows, MOMENTS_BLOCK)
    return (n_row_blocks + runtime.cdiv(cols, MOMENTS_BLOCK),), {
        "row_state_ptr": a.exp_avg_sq_row,
        "col_state_ptr": a.exp_avg_sq_col,
        "ws_ptr": a.workspace,
        "rows": rows,
        "cols": cols,
        "n_row_blocks": n_row_blocks,
        "beta2_ptr": a.beta2,
        "clip_coef_ptr": a.clip_coef,
        "eps0": float(a.eps0),
        "BLOCK": MOMENTS_BLOCK,
    }


def factored_norm_args(a: Any) -> runtime.Launch:
    """Pass B: sum of update^2."""
    grid, tiles = _update_launch(a, a.grad.device)
    return grid, {**tiles, **_grad_kwargs(a), **_clip_coef_kwargs(a)}


def factored_apply_args(a: Any) -> runtime.Launch:
    """Pass C: the write-back."""
    grid, tiles = _update_launch(a, a.param.device)
    return grid, {
        **tiles,
        **runtime.param_kwargs(a.param),
        **_write_back_kwargs(a, a.exp_avg_sq_row.numel() * a.exp_avg_sq_col.numel()),
        **_grad_kwargs(a),
        **_clip_coef_kwargs(a),
    }


def vector_stats_args(a: Any) -> runtime.Launch:
    """Pass A1: sum of update^2 and of p^2 of a 1-D tensor."""
    grid, vector = _vector_launch(a)
    return grid, {
        **vector,
        "found_inf_ptr": a.found_inf,
        "skip_if_ptr": a.skip_if,
        **_grad_kwargs(a),
        **_clip_coef_kwargs(a),
    }


def vector_apply_args(a: Any) -> runtime.Launch:
    """Pass C1: the write-back of a 1-D tensor and its second moment, rounded as pass C."""
    grid, vector = _vector_launch(a)
    return grid, {
        **vector,
        "offset": a.offset,
        **_write_back_kwargs(a, a.full_numel),
        **_grad_kwargs(a),
        **_clip_coef_kwargs(a),
    }


# The passes, one launch each. The kernel module is looked up at each launch (`_kernels`).
factored_stats_ = runtime.launcher(
    FACTORED_STATS, factored_stats_args, lambda: _kernels().factored_stats_kernel, NUM_WARPS
)
factored_moments_ = runtime.launcher(
    FACTORED_MOMENTS,
    factored_moments_args,
    lambda: _kernels().factored_moments_kernel,
    MOMENTS_NUM_WARPS,
)
factored_norm_ = runtime.launcher(
    FACTORED_NORM, factored_norm_args, lambda: _kernels().factored_norm_kernel, NUM_WARPS
)
factored_apply_ = runtime.launcher(
    FACTORED_APPLY, factored_apply_args, lambda: _kernels().factored_apply_kernel, NUM_WARPS
)
vector_stats_ = runtime.launcher(
    VECTOR_STATS, vector_stats_args, lambda: _kernels().vector_stats_kernel, NUM_WARPS
)
vector_apply_ = runtime.launcher(
    VECTOR_APPLY, vector_apply_args, lambda: _kernels().vector_apply_kernel, NUM_WARPS
)
