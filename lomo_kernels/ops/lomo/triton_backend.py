"""Triton launchers of the LOMO update ops (kernels: `lomo_kernels.py`; the 8-bit blockwise
buffer's: `int8_buffer_kernels.py`).

Same arguments and semantics as `lomo_kernels.ops.lomo.reference`. Runs on CUDA tensors, or
on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1). One launch per op, no host
sync: the runtime scalars are read by the kernel from device memory, and skip_if suppresses
every write on the device. Importing this module never imports triton.
"""

from __future__ import annotations

from typing import Any

import torch

from ...core.int8_blocks import INT8_BLOCK, blocks_of
from ...kernels.triton import runtime
from ...kernels.triton.runtime import is_available, unavailable_reason  # the backend interface
from .spec import (
    GRAD_ACCUMULATE,
    GRAD_ACCUMULATE_INT8,
    GRAD_SUMSQ,
    INT8_DEQUANTIZE,
    LOMO_UPDATE,
    LOMO_UPDATE_INT8,
)

# 16 elements per thread with 8 warps: four 128-bit loads in flight per fp32 tensor and a
# small register footprint (no spills, see tests/runtime.kernels/test_triton_static.py).
BLOCK = 4096
NUM_WARPS = 8
# The bulk bound is a multiple of this so the JIT marks it divisible by 16.
ALIGN = 16
# The 8-bit buffer's kernels take rows of INT8_BLOCK elements, as many per program as BLOCK.
INT8_ROWS = BLOCK // INT8_BLOCK

__all__ = [
    "grad_accumulate_",
    "grad_accumulate_int8_",
    "grad_sumsq_",
    "int8_dequantize_",
    "is_available",
    "lomo_update_",
    "lomo_update_int8_",
    "unavailable_reason",
]


def _grid(n_bulk: int, n: int) -> tuple[int]:
    # None for an empty tensor; else at least one program: it handles the tail when there is
    # no bulk.
    return (max(1, runtime.cdiv(n_bulk, BLOCK)) if n else 0,)


def lomo_update_args(a: Any) -> runtime.Launch:
    """Grid and arguments, by kernel parameter name, of the update launch for the op's
    arguments `a` (``LOMO_UPDATE.Arguments``)."""
    n = a.param.numel()
    n_bulk = n - n % ALIGN
    args = {
        **runtime.param_kwargs(a.param),
        **runtime.grad_kwargs(a.grad, a.inv_scale, a.clip_value),
        "n_bulk": n_bulk,
        "n": n,
        "offset": a.offset,
        "weight_decay": float(a.weight_decay),
        "lr_ptr": a.lr,
        "clip_coef_ptr": a.clip_coef,
        "found_inf_ptr": a.found_inf,
        "skip_if_ptr": runtime.snapshot_skip_flag(a.skip_if, a.found_inf),
        **runtime.rounding_kwargs(a.param, a.stochastic_rounding, a.seed, a.seed_step),
        "BLOCK": BLOCK,
    }
    return _grid(n_bulk, n), args


def grad_sumsq_args(a: Any) -> runtime.Launch:
    """Grid and arguments, by kernel parameter name, of the sum-of-squares launch for the op's
    arguments `a` (``GRAD_SUMSQ.Arguments``)."""
    n = a.grad.numel()
    n_bulk = n - n % ALIGN
    args = {
        "grad_ptr": runtime.storage(a.grad),
        "n_bulk": n_bulk,
        "n": n,
        "inv_scale_ptr": a.inv_scale,
        "sumsq_ptr": a.sumsq,
        "found_inf_ptr": a.found_inf,
        "GRAD_KIND": runtime.KIND[a.grad.dtype],
        "BLOCK": BLOCK,
    }
    return _grid(n_bulk, n), args


def grad_accumulate_args(a: Any) -> runtime.Launch:
    """Grid and arguments, by kernel parameter name, of the accumulation launch for the op's
    arguments `a` (``GRAD_ACCUMULATE.Arguments``)."""
    n = a.buffer.numel()
    n_bulk = n - n % ALIGN
    rounding = runtime.rounding_kwargs(a.buffer, a.stochastic_rounding, a.seed, a.seed_step)
    args = {
        "buffer_ptr": runtime.storage(a.buffer),
        "grad_ptr": runtime.storage(a.grad),
        "n_bulk": n_bulk,
        "n": n,
        "offset": a.offset,
        "seed_lo": rounding["seed_lo"],
        "seed_hi": rounding["seed_hi"],
        "inv_scale_ptr": a.inv_scale,
        "sumsq_ptr": a.sumsq,
        "found_inf_ptr": a.found_inf,
        "seed_step_ptr": rounding["seed_step_ptr"],
        "FIRST": bool(a.first),
        "BUFFER_KIND": runtime.KIND[a.buffer.dtype],
        "GRAD_KIND": runtime.KIND[a.grad.dtype],
        "STOCHASTIC_ROUNDING": rounding["STOCHASTIC_ROUNDING"],
        "BLOCK": BLOCK,
    }
    return _grid(n_bulk, n), args


def grad_accumulate_int8_args(a: Any) -> runtime.Launch:
    """Grid and arguments, by kernel parameter name, of the 8-bit accumulation launch for the
    op's arguments `a` (``GRAD_ACCUMULATE_INT8.Arguments``): a program per INT8_ROWS blocks."""
    n = a.grad.numel()
    n_blocks = blocks_of(a.offset, n)
    args = {
        "codes_ptr": a.codes,
        "scales_ptr": a.scales,
        "grad_ptr": runtime.storage(a.grad),
        "n": n,
        "n_blocks": n_blocks,
        "offset": a.offset,
        "lead": a.offset % INT8_BLOCK,
        "inv_scale_ptr": a.inv_scale,
        "sumsq_ptr": a.sumsq,
        "found_inf_ptr": a.found_inf,
        # Codes are always rounded: stochastically for every gradient dtype.
        **runtime.stochastic_kwargs(bool(a.stochastic_rounding), a.seed, a.seed_step),
        "FIRST": bool(a.first),
        "GRAD_KIND": runtime.KIND[a.grad.dtype],
        "ROWS": INT8_ROWS,
    }
    return (runtime.cdiv(n_blocks, INT8_ROWS),), args


def lomo_update_int8_args(a: Any) -> runtime.Launch:
    """Grid and arguments, by kernel parameter name, of the update from an 8-bit buffer for
    the op's arguments `a` (``LOMO_UPDATE_INT8.Arguments``)."""
    n = a.param.numel()
    n_bulk = n - n % ALIGN
    args = {
        **runtime.param_kwargs(a.param),
        "codes_ptr": a.codes,
        "scales_ptr": a.scales,
        "n_bulk": n_bulk,
        "n": n,
        "n_blocks": blocks_of(a.offset, n),
        "offset": a.offset,
        "lead": a.offset % INT8_BLOCK,
        **runtime.transform_kwargs(a.inv_scale, a.clip_value),
        "weight_decay": float(a.weight_decay),
        "lr_ptr": a.lr,
        "clip_coef_ptr": a.clip_coef,
        "found_inf_ptr": a.found_inf,
        "skip_if_ptr": runtime.snapshot_skip_flag(a.skip_if, a.found_inf),
        **runtime.rounding_kwargs(a.param, a.stochastic_rounding, a.seed, a.seed_step),
        "ROWS": INT8_ROWS,
    }
    return _grid(n_bulk, n), args


def int8_dequantize_args(a: Any) -> runtime.Launch:
    """Grid and arguments, by kernel parameter name, of the dequantisation launch for the
    op's arguments `a` (``INT8_DEQUANTIZE.Arguments``)."""
    n = a.out.numel()
    n_bulk = n - n % ALIGN
    args = {
        "out_ptr": runtime.storage(a.out),
        "codes_ptr": a.codes,
        "scales_ptr": a.scales,
        "n_bulk": n_bulk,
        "n": n,
        "n_blocks": blocks_of(a.offset, n),
        "lead": a.offset % INT8_BLOCK,
        "OUT_KIND": runtime.KIND[a.out.dtype],
        "ROWS": INT8_ROWS,
    }
    return _grid(n_bulk, n), args


# One LOMO step on one contiguous parameter, in place, in one launch (arguments and semantics
# of `ops.lomo.reference.lomo_update_`).
lomo_update_ = runtime.launcher(
    LOMO_UPDATE,
    lomo_update_args,
    lambda: runtime.kernels("lomo_kernels").lomo_update_kernel,
    NUM_WARPS,
)
# sumsq += sum((fp32(grad) * inv_scale) ** 2), found_inf raised on inf/nan, one launch.
# Partial sums are added atomically, so the summation order (and the last bits of sumsq)
# differ from the reference's float64 sum.
grad_sumsq_ = runtime.launcher(
    GRAD_SUMSQ,
    grad_sumsq_args,
    lambda: runtime.kernels("lomo_kernels").grad_sumsq_kernel,
    NUM_WARPS,
)
# buffer = round(buffer + grad) (first: round(grad)), the stored values' scaled sum of squares
# added atomically and found_inf raised on inf/nan, one launch.
grad_accumulate_ = runtime.launcher(
    GRAD_ACCUMULATE,
    grad_accumulate_args,
    lambda: runtime.kernels("lomo_kernels").grad_accumulate_kernel,
    NUM_WARPS,
)

# The 8-bit blockwise buffer (`core/int8_blocks.py`), one launch each: a micro-batch's
# gradient added into it (codes, scales, the stored values' scaled sum of squares added
# atomically and found_inf), the LOMO step reading it, its values written out.
grad_accumulate_int8_ = runtime.launcher(
    GRAD_ACCUMULATE_INT8,
    grad_accumulate_int8_args,
    lambda: runtime.kernels("int8_buffer_kernels").grad_accumulate_int8_kernel,
    NUM_WARPS,
)
lomo_update_int8_ = runtime.launcher(
    LOMO_UPDATE_INT8,
    lomo_update_int8_args,
    lambda: runtime.kernels("int8_buffer_kernels").lomo_update_int8_kernel,
    NUM_WARPS,
)
int8_dequantize_ = runtime.launcher(
    INT8_DEQUANTIZE,
    int8_dequantize_args,
    lambda: runtime.kernels("int8_buffer_kernels").int8_dequantize_kernel,
    NUM_WARPS,
)

# ----------------------------------------------------------------------------- ahead of time

_TRITON_TYPE = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.int64: "i64",
}


def aot_signature(kernel: Any, args: dict[str, Any]) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) for `triton.compiler.ASTSource`, specialised as the JIT
    specialises a launch with `args`: tensors and ints divisible by 16 get tt.divisibility,
    ints equal to 1 and None become constants, `do_not_specialize` parameters stay generic."""
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    attrs: dict[tuple[int], list] = {}
    for index, param in enumerate(kernel.params):
        value = args[param.name]
        specialize = not param.do_not_specialize
        if (
            param.is_constexpr
            or value is None
            or (type(value) is int and value == 1 and specialize)
        ):
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
            continue
        if isinstance(value, torch.Tensor):
            signature[param.name] = "*" + _TRITON_TYPE[value.dtype]
            divisible = value.data_ptr() % 16 == 0
        elif isinstance(value, int):
            signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            divisible = value % 16 == 0
        elif isinstance(value, float):
            signature[param.name] = "fp32"
            divisible = False
        else:
            raise TypeError(f"no Triton type for {param.name}={value!r}")
        if divisible and specialize:
            attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


def _aot(
    kernel_name: str, launch: runtime.Launch, module: str = "lomo_kernels"
) -> tuple[Any, dict, dict, dict]:
    """(kernel, signature, constexprs, attrs) of the named kernel of the kernel module
    `module` for a launch's arguments."""
    kernel = getattr(runtime.kernels(module), kernel_name)
    return (kernel, *aot_signature(kernel, launch[1]))


def aot_update(
    param_dtype: torch.dtype,
    grad_dtype: torch.dtype,
    *,
    stochastic_rounding: bool = False,
    offset: int = 0,
) -> tuple[Any, dict, dict, dict]:
    """(kernel, signature, constexprs, attrs) of the update with every optional input given,
    for an aligned parameter whose numel is not a multiple of 16 (the slice at `offset` of
    its parameter)."""
    n = 2 * BLOCK + 5
    flag = torch.zeros(1)
    launch = lomo_update_args(
        LOMO_UPDATE.Arguments(
            torch.empty(n, dtype=param_dtype),
            torch.empty(n, dtype=grad_dtype),
            torch.full((1,), 1e-3),
            torch.ones(1),
            1.0,
            torch.ones(1),
            0.1,
            flag,
            torch.zeros(1),
            stochastic_rounding,
            12345,
            torch.zeros(1, dtype=torch.int64),
            offset,
        )
    )
    return _aot("lomo_update_kernel", launch)


def aot_grad_sumsq(grad_dtype: torch.dtype) -> tuple[Any, dict, dict, dict]:
    """(kernel, signature, constexprs, attrs) of the sum of squares, as `aot_update`."""
    n = 2 * BLOCK + 5
    launch = grad_sumsq_args(
        GRAD_SUMSQ.Arguments(
            torch.empty(n, dtype=grad_dtype), torch.ones(1), torch.zeros(1), torch.zeros(1)
        )
    )
    return _aot("grad_sumsq_kernel", launch)


def aot_grad_accumulate(
    buffer_dtype: torch.dtype,
    grad_dtype: torch.dtype,
    *,
    first: bool = False,
    stochastic_rounding: bool = False,
    offset: int = 0,
) -> tuple[Any, dict, dict, dict]:
    """(kernel, signature, constexprs, attrs) of the accumulation with sumsq, found_inf and
    the per-step seed given, as `aot_update`."""
    n = 2 * BLOCK + 5
    launch = grad_accumulate_args(
        GRAD_ACCUMULATE.Arguments(
            torch.empty(n, dtype=buffer_dtype),
            torch.empty(n, dtype=grad_dtype),
            first,
            torch.ones(1),
            torch.zeros(1),
            torch.zeros(1),
            stochastic_rounding,
            12345,
            torch.zeros(1, dtype=torch.int64),
            offset,
        )
    )
    return _aot("grad_accumulate_kernel", launch)


def _int8_buffer(n: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised codes and scales of an 8-bit buffer of n elements at `offset`."""
    return torch.empty(n, dtype=torch.int8), torch.empty(blocks_of(offset, n))


def aot_grad_accumulate_int8(
    grad_dtype: torch.dtype,
    *,
    first: bool = False,
    stochastic_rounding: bool = False,
    offset: int = 0,
) -> tuple[Any, dict, dict, dict]:
    """(kernel, signature, constexprs, attrs) of the 8-bit accumulation with sumsq, found_inf
    and the per-step seed given, of 2 * BLOCK + 5 elements at `offset` (its lead, offset %
    INT8_BLOCK, specialised as the JIT does)."""
    n = 2 * BLOCK + 5
    launch = grad_accumulate_int8_args(
        GRAD_ACCUMULATE_INT8.Arguments(
            *_int8_buffer(n, offset),
            torch.empty(n, dtype=grad_dtype),
            offset,
            first,
            torch.ones(1),
            torch.zeros(1),
            torch.zeros(1),
            stochastic_rounding,
            12345,
            torch.zeros(1, dtype=torch.int64),
        )
    )
    return _aot("grad_accumulate_int8_kernel", launch, "int8_buffer_kernels")


def aot_update_int8(
    param_dtype: torch.dtype, *, stochastic_rounding: bool = False, offset: int = 0
) -> tuple[Any, dict, dict, dict]:
    """(kernel, signature, constexprs, attrs) of the update from an 8-bit buffer with every
    optional input given, as `aot_update`, the slice at `offset` of its parameter."""
    n = 2 * BLOCK + 5
    launch = lomo_update_int8_args(
        LOMO_UPDATE_INT8.Arguments(
            torch.empty(n, dtype=param_dtype),
            *_int8_buffer(n, offset),
            offset,
            torch.full((1,), 1e-3),
            torch.ones(1),
            1.0,
            torch.ones(1),
            0.1,
            torch.zeros(1),
            torch.zeros(1),
            stochastic_rounding,
            12345,
            torch.zeros(1, dtype=torch.int64),
        )
    )
    return _aot("lomo_update_int8_kernel", launch, "int8_buffer_kernels")


def aot_int8_dequantize(out_dtype: torch.dtype, *, offset: int = 0) -> tuple[Any, dict, dict, dict]:
    """(kernel, signature, constexprs, attrs) of the dequantisation, as `aot_update`."""
    n = 2 * BLOCK + 5
    launch = int8_dequantize_args(
        INT8_DEQUANTIZE.Arguments(torch.empty(n, dtype=out_dtype), *_int8_buffer(n, offset), offset)
    )
    return _aot("int8_dequantize_kernel", launch, "int8_buffer_kernels")
