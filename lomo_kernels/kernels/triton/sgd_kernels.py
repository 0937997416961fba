"""Fused LOMO SGD update and gradient sum of squares, as Triton kernels.

Each kernel makes one pass over one contiguous parameter. The numel n is split into an
aligned bulk of `n - n % 16` elements, masked with a bound the JIT specialises as divisible
by 16 (so loads and stores are 128-bit wide), and a tail of fewer than 16 elements handled
by the last program. bf16 values travel as int16 bit patterns and are rounded with integer
operations, so the interpreter and the GPU write identical bits (see `_rounding.py`).
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

import torch
import triton
import triton.language as tl

from .. import _rounding

# 16 elements per thread with 8 warps: four 128-bit loads in flight per fp32 tensor and a
# small register footprint (no spills, see tests/test_triton_static.py).
BLOCK = 4096
NUM_WARPS = 8
# The bulk bound is a multiple of this so the JIT marks it divisible by 16.
_ALIGN = 16

# Kind codes of the element types the kernels load and store.
_FP32, _FP16, _BF16 = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
_KIND = {torch.float32: _FP32.value, torch.float16: _FP16.value, torch.bfloat16: _BF16.value}

_MUL_1 = tl.constexpr(_rounding._HASH_MUL_1)
_MUL_2 = tl.constexpr(_rounding._HASH_MUL_2)

# tl.max / tl.sum are @triton.jit functions decorated for the mode active when triton was
# first imported, so they break the interpreter if TRITON_INTERPRET was set later. The
# builtin tl.reduce with their combine functions compiles to the same code and is
# recognised by the interpreter in either case.
_MAX = tl.standard._elementwise_max
_SUM = tl.standard._sum_combine


def interpret_mode() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# triton.jit chooses compiler or interpreter when a function is decorated.
_DECORATED_FOR_INTERPRETER = interpret_mode()


def _ensure_decoration_mode() -> None:
    """Re-decorates the kernels if TRITON_INTERPRET changed since this module was imported."""
    if interpret_mode() != _DECORATED_FOR_INTERPRETER:
        importlib.reload(sys.modules[__name__])


# ----------------------------------------------------------------------------- device code


@triton.jit
def _mix32(x):
    """lowbias32 finaliser on uint32 (wrapping multiplies), as `_rounding.mix32`."""
    x ^= x >> 16
    x *= _MUL_1
    x ^= x >> 15
    x *= _MUL_2
    x ^= x >> 16
    return x


@triton.jit
def _to_fp32(raw, KIND: tl.constexpr):
    if KIND == _BF16:
        # bf16 bits are the top half of the fp32 bits: exact, no cast.
        return (raw.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return raw.to(tl.float32)


@triton.jit
def _from_fp32(value, offs, key, KIND: tl.constexpr, STOCHASTIC_ROUNDING: tl.constexpr):
    """`value` in the parameter's storage type; bf16 as int16 bits per `fp32_to_bf16_bits`."""
    if KIND == _FP32:
        return value
    elif KIND == _FP16:
        return value.to(tl.float16)
    else:
        bits = value.to(tl.uint32, bitcast=True)
        magnitude = bits & 0x7FFFFFFF
        if STOCHASTIC_ROUNDING:
            lo = offs.to(tl.uint32)
            hi = (offs >> 32).to(tl.uint32)
            random16 = _mix32(_mix32(lo ^ key) ^ hi) >> 16
            # inf has 16 zero low bits, so adding random16 cannot carry: it stays inf.
            rounded = (bits + random16) >> 16
        else:
            # Round to nearest even; wraps only for NaN patterns, replaced below.
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(magnitude > 0x7F800000, (bits >> 16) | 0x40, rounded)
        return rounded.to(tl.int16)


@triton.jit
def _update_chunk(
    param_ptr,
    grad_ptr,
    offs,
    mask,
    lr,
    decay,
    inv_scale,
    clip_value,
    clip_coef,
    key,
    PARAM_KIND: tl.constexpr,
    GRAD_KIND: tl.constexpr,
    HAS_CLIP_VALUE: tl.constexpr,
    HAS_CLIP_COEF: tl.constexpr,
    STOCHASTIC_ROUNDING: tl.constexpr,
):
    """Updates the elements `offs[mask]`; returns 1 if any gradient was non-finite, else 0."""
    g = _to_fp32(tl.load(grad_ptr + offs, mask=mask, other=0), GRAD_KIND) * inv_scale
    finite = tl.abs(g) < float("inf")
    if HAS_CLIP_VALUE:
        g = tl.minimum(tl.maximum(g, -clip_value), clip_value)
    if HAS_CLIP_COEF:
        g = g * clip_coef
    raw = tl.load(param_ptr + offs, mask=mask, other=0)
    new = _to_fp32(raw, PARAM_KIND) * decay - lr * g
    out = _from_fp32(new, offs, key, PARAM_KIND, STOCHASTIC_ROUNDING)
    # Rewriting the old bits instead of masking them out keeps the store mask uniform
    # over 16 elements, which the 128-bit stores need.
    tl.store(param_ptr + offs, tl.where(finite, out, raw), mask=mask)
    return tl.reduce((~finite).to(tl.int32), 0, _MAX)


@triton.jit(do_not_specialize=["n", "key"])
def _sgd_update_kernel(
    param_ptr,
    grad_ptr,
    n_bulk,
    n,
    lr,
    decay,
    weight_decay,
    inv_scale,
    clip_value,
    clip_coef,
    key,
    lr_tensor_ptr,
    inv_scale_tensor_ptr,
    clip_coef_tensor_ptr,
    found_inf_ptr,
    skip_if_ptr,
    PARAM_KIND: tl.constexpr,
    GRAD_KIND: tl.constexpr,
    HAS_CLIP_VALUE: tl.constexpr,
    HAS_CLIP_COEF: tl.constexpr,
    STOCHASTIC_ROUNDING: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """p = p * decay - lr * clip(g * inv_scale) * clip_coef on one flat parameter.

    A `*_tensor_ptr`, `found_inf_ptr` or `skip_if_ptr` that is None selects the code path
    without it (None arguments are compile-time constants).
    """
    run = tl.load(skip_if_ptr) == 0 if skip_if_ptr is not None else True
    if run:
        lr_eff = lr
        decay_eff = decay
        if lr_tensor_ptr is not None:
            lr_eff = lr * tl.load(lr_tensor_ptr)
            decay_eff = 1.0 - lr_eff * weight_decay
        inv_scale_eff = inv_scale
        if inv_scale_tensor_ptr is not None:
            inv_scale_eff = inv_scale * tl.load(inv_scale_tensor_ptr)
        clip_coef_eff = clip_coef
        if clip_coef_tensor_ptr is not None:
            clip_coef_eff = clip_coef * tl.load(clip_coef_tensor_ptr)
        ukey = key.to(tl.uint32, bitcast=True)

        pid = tl.program_id(0).to(tl.int64)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        bad = _update_chunk(
            param_ptr,
            grad_ptr,
            offs,
            offs < n_bulk,
            lr_eff,
            decay_eff,
            inv_scale_eff,
            clip_value,
            clip_coef_eff,
            ukey,
            PARAM_KIND,
            GRAD_KIND,
            HAS_CLIP_VALUE,
            HAS_CLIP_COEF,
            STOCHASTIC_ROUNDING,
        )
        if pid == tl.num_programs(0) - 1:
            tail = n_bulk.to(tl.int64) + tl.arange(0, 16)
            tail_bad = _update_chunk(
                param_ptr,
                grad_ptr,
                tail,
                tail < n,
                lr_eff,
                decay_eff,
                inv_scale_eff,
                clip_value,
                clip_coef_eff,
                ukey,
                PARAM_KIND,
                GRAD_KIND,
                HAS_CLIP_VALUE,
                HAS_CLIP_COEF,
                STOCHASTIC_ROUNDING,
            )
            bad = tl.maximum(bad, tail_bad)
        # A compile-time branch around a run-time one; `and` would compile both sides.
        if found_inf_ptr is not None:  # noqa: SIM102
            if bad > 0:
                tl.atomic_max(found_inf_ptr, 1.0)


@triton.jit
def _sumsq_chunk(grad_ptr, offs, mask, inv_scale, GRAD_KIND: tl.constexpr):
    """(sum of squares, 1 if any non-finite else 0) of the scaled gradient over `offs[mask]`."""
    g = _to_fp32(tl.load(grad_ptr + offs, mask=mask, other=0), GRAD_KIND) * inv_scale
    bad = tl.reduce((~(tl.abs(g) < float("inf"))).to(tl.int32), 0, _MAX)
    return tl.reduce(g * g, 0, _SUM), bad


@triton.jit(do_not_specialize=["n"])
def _grad_sumsq_kernel(
    grad_ptr,
    n_bulk,
    n,
    inv_scale,
    inv_scale_tensor_ptr,
    sumsq_ptr,
    found_inf_ptr,
    GRAD_KIND: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """sumsq += sum((g * inv_scale) ** 2) with one atomic add per program."""
    if inv_scale_tensor_ptr is not None:
        inv_scale = inv_scale * tl.load(inv_scale_tensor_ptr)
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    total, bad = _sumsq_chunk(grad_ptr, offs, offs < n_bulk, inv_scale, GRAD_KIND)
    if pid == tl.num_programs(0) - 1:
        tail = n_bulk.to(tl.int64) + tl.arange(0, 16)
        tail_total, tail_bad = _sumsq_chunk(grad_ptr, tail, tail < n, inv_scale, GRAD_KIND)
        total += tail_total
        bad = tl.maximum(bad, tail_bad)
    tl.atomic_add(sumsq_ptr, total, sem="relaxed")
    if found_inf_ptr is not None:  # noqa: SIM102 (compile-time branch, see above)
        if bad > 0:
            tl.atomic_max(found_inf_ptr, 1.0)


# ----------------------------------------------------------------------------- launchers


def _storage(t: torch.Tensor) -> torch.Tensor:
    """The tensor the kernels address: bf16 as its int16 bit patterns."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _grid(n_bulk: int) -> tuple[int]:
    # At least one program: it handles the tail when there is no bulk.
    return (max(1, triton.cdiv(n_bulk, BLOCK)),)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def sgd_update_args(
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
) -> tuple[tuple[int], dict[str, Any]]:
    """Grid and arguments, by kernel parameter name, of the update launch for these inputs."""
    n = param.numel()
    n_bulk = n - n % _ALIGN
    if skip_if is not None and found_inf is not None and _same_storage(skip_if, found_inf):
        # Programs of one launch must not see a found_inf set by a sibling as skip_if.
        skip_if = skip_if.clone()
    key = _rounding.seed_key(seed) if stochastic_rounding else 0
    args = {
        "param_ptr": _storage(param),
        "grad_ptr": _storage(grad),
        "n_bulk": n_bulk,
        "n": n,
        "lr": float(lr),
        # Same expression as the reference (host double, then fp32); with a device lr the
        # kernel computes it in fp32.
        "decay": 1.0 - lr * weight_decay,
        "weight_decay": float(weight_decay),
        "inv_scale": float(inv_scale),
        "clip_value": 0.0 if clip_value is None else float(clip_value),
        "clip_coef": float(clip_coef),
        # The uint32 key passed as int32 bits: one signature for every seed.
        "key": key - (1 << 32) if key >= (1 << 31) else key,
        "lr_tensor_ptr": lr_tensor,
        "inv_scale_tensor_ptr": inv_scale_tensor,
        "clip_coef_tensor_ptr": clip_coef_tensor,
        "found_inf_ptr": found_inf,
        "skip_if_ptr": skip_if,
        "PARAM_KIND": _KIND[param.dtype],
        "GRAD_KIND": _KIND[grad.dtype],
        "HAS_CLIP_VALUE": clip_value is not None,
        "HAS_CLIP_COEF": clip_coef_tensor is not None or clip_coef != 1.0,
        "STOCHASTIC_ROUNDING": bool(stochastic_rounding) and param.dtype == torch.bfloat16,
        "BLOCK": BLOCK,
    }
    return _grid(n_bulk), args


def grad_sumsq_args(
    grad: torch.Tensor,
    *,
    inv_scale: float,
    inv_scale_tensor: torch.Tensor | None,
    sumsq: torch.Tensor,
    found_inf: torch.Tensor | None,
) -> tuple[tuple[int], dict[str, Any]]:
    """Grid and arguments, by kernel parameter name, of the sum-of-squares launch."""
    n = grad.numel()
    n_bulk = n - n % _ALIGN
    args = {
        "grad_ptr": _storage(grad),
        "n_bulk": n_bulk,
        "n": n,
        "inv_scale": float(inv_scale),
        "inv_scale_tensor_ptr": inv_scale_tensor,
        "sumsq_ptr": sumsq,
        "found_inf_ptr": found_inf,
        "GRAD_KIND": _KIND[grad.dtype],
        "BLOCK": BLOCK,
    }
    return _grid(n_bulk), args


def sgd_update(param: torch.Tensor, grad: torch.Tensor, **options: Any) -> None:
    """Launches the fused update; `options` are the keyword arguments of `sgd_update_args`."""
    if param.numel() == 0:
        return
    _ensure_decoration_mode()
    grid, args = sgd_update_args(param, grad, **options)
    _sgd_update_kernel[grid](**args, num_warps=NUM_WARPS)


def grad_sumsq(grad: torch.Tensor, **options: Any) -> None:
    """Launches the sum of squares; `options` are the keyword arguments of `grad_sumsq_args`."""
    if grad.numel() == 0:
        return
    _ensure_decoration_mode()
    grid, args = grad_sumsq_args(grad, **options)
    _grad_sumsq_kernel[grid](**args, num_warps=NUM_WARPS)


# ----------------------------------------------------------------------------- ahead of time

_TRITON_TYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.int16: "i16"}


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


def aot_update(
    param_dtype: torch.dtype, grad_dtype: torch.dtype, *, stochastic_rounding: bool = False
) -> tuple[Any, dict, dict, dict]:
    """(kernel, signature, constexprs, attrs) of the update with every optional input given,
    for an aligned parameter whose numel is not a multiple of 16."""
    n = 2 * BLOCK + 5
    flag = torch.zeros(1)
    _, args = sgd_update_args(
        torch.empty(n, dtype=param_dtype),
        torch.empty(n, dtype=grad_dtype),
        lr=1e-3,
        lr_tensor=torch.ones(1),
        inv_scale=1.0,
        inv_scale_tensor=torch.ones(1),
        clip_value=1.0,
        clip_coef=1.0,
        clip_coef_tensor=torch.ones(1),
        weight_decay=0.1,
        found_inf=flag,
        skip_if=torch.zeros(1),
        stochastic_rounding=stochastic_rounding,
        seed=12345,
    )
    return (_sgd_update_kernel, *aot_signature(_sgd_update_kernel, args))


def aot_grad_sumsq(grad_dtype: torch.dtype) -> tuple[Any, dict, dict, dict]:
    """(kernel, signature, constexprs, attrs) of the sum of squares, as `aot_update`."""
    n = 2 * BLOCK + 5
    _, args = grad_sumsq_args(
        torch.empty(n, dtype=grad_dtype),
        inv_scale=1.0,
        inv_scale_tensor=torch.ones(1),
        sumsq=torch.zeros(1),
        found_inf=torch.zeros(1),
    )
    return (_grad_sumsq_kernel, *aot_signature(_grad_sumsq_kernel, args))
