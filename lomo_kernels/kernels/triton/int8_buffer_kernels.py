"""The 8-bit blockwise accumulation buffer (`core/int8_blocks.py`): the Triton device code of
its accumulation, of the LOMO update reading it and of its dequantisation (launchers:
`ops/lomo/triton_backend.py`).

The accumulation needs each block's absmax before it can round: a program takes a tile of
whole blocks, [ROWS, INT8_BLOCK] with row r the buffer's block ``pid * ROWS + r`` and element
``j = row * INT8_BLOCK + col - lead`` (lead = offset % INT8_BLOCK: the first block's part
before the buffer), masked to [0, n). It forms the new values once, takes each row's absmax
and scale, stores codes and scales: one pass over memory. A lead the JIT knows divisible by
16 keeps the loads and stores 128 bits wide; only the last program, which holds the buffer's
end, masks by n (every other one lies before it).

The update and the dequantisation are element-wise: their tiles follow the parameter's own
alignment (the bulk/tail split of `lomo_kernels.py`, whatever the lead), a row of 256
elements spanning at most two blocks, whose two scales the row reads once; each element picks
its own. The update's math is `update_elements` (lomo_kernels.py) with the gradient code * scale.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...core.int8_blocks import (
    INT8_BLOCK,
    INT8_MANTISSA_LIMIT,
    INT8_MAX_CODE,
    INT8_MIN_EXPONENT,
)
from ...core.torch_internals import triton_reduce_combines
from .runtime import interpret_mode, kernels

# tl.max / tl.sum break the interpreter when TRITON_INTERPRET was set late (lomo_kernels.py).
_MAX, _SUM = triton_reduce_combines()

# triton.jit picks interpreter or compiler when a kernel is decorated (runtime.kernels).
DECORATED_FOR_INTERPRETER = interpret_mode()
_shared = kernels("rounding_kernels")
_rounding_key, _factor, _load_fp32 = _shared.rounding_key, _shared.factor, _shared.load_fp32
_grad_source, _gradient_of = _shared.grad_source, _shared.gradient_of
_pair_random16, _stored = _shared.pair_random16, _shared.stored
_update_elements = kernels("lomo_kernels").update_elements

_BLOCK = tl.constexpr(INT8_BLOCK)
_MANTISSA_LIMIT = tl.constexpr(INT8_MANTISSA_LIMIT)
_MIN_EXPONENT = tl.constexpr(INT8_MIN_EXPONENT)
_MAX_CODE = tl.constexpr(float(INT8_MAX_CODE))
# fp32 additions round to nearest even: adding and taking away 1.5 * 2**23 leaves a value of
# magnitude below 2**22 rounded to an integer, half to even (the reference's torch.round; no
# libdevice rint under the interpreter). The compiler fuses the first addition with x's
# product value * (1 / scale), which is exact: the same sum.
_ROUNDING_SHIFT = tl.constexpr(12582912.0)
_TWO_POW_M17 = tl.constexpr(2.0**-17)


# ----------------------------------------------------------------------------- block scales


@triton.jit
def power_of_two(absmax):
    """(scale, 1 / scale) of blocks with the finite largest magnitudes `absmax` (fp32), from
    absmax's bits (`reference.int8_power_of_two`): 2**e for the smallest e >= -126 with
    absmax <= 127 * 2**e; both 0 for an all-zero block."""
    bits = absmax.to(tl.int32, bitcast=True)
    # absmax = m * 2**E: e = E - 6 (127 / 64 < 2), E - 5 for an m past 127 / 64.
    big = ((bits & 0x7FFFFF) > _MANTISSA_LIMIT).to(tl.int32)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127 - 6 + big, _MIN_EXPONENT)
    scale = ((exponent + 127) << 23).to(tl.float32, bitcast=True)
    inverse = ((127 - exponent) << 23).to(tl.float32, bitcast=True)
    zero = absmax == 0
    return tl.where(zero, 0.0, scale), tl.where(zero, 0.0, inverse)


@triton.jit
def quantised(x, index, key, STOCHASTIC_ROUNDING: tl.constexpr):
    """Codes (fp32 integers in [-127, 127]) of x = value / scale: to nearest even, or
    x + u to nearest even with u = (2 r + 1 - 2**16) / 2**17 for r the accumulation's 16
    bits (`pair_random16`) of the flat indices `index` (int64): a centred offset in
    (-1/2, 1/2) (`reference.int8_stochastic_codes`)."""
    if STOCHASTIC_ROUNDING:
        centred = _pair_random16(index, key).to(tl.int32) * 2 + (1 - 65536)
        x = x + centred.to(tl.float32) * _TWO_POW_M17
    q = (x + _ROUNDING_SHIFT) - _ROUNDING_SHIFT
    return tl.minimum(tl.maximum(q, -_MAX_CODE), _MAX_CODE)


@triton.jit
def _any(flags):
    """1 if any of the [rows, cols] int32 flags is set, else 0."""
    return tl.reduce(tl.reduce(flags, 1, _MAX), 0, _MAX)


# ----------------------------------------------------------------------------- accumulation


@triton.jit
def _accumulate_blocks(
    buffer,
    grad_ptr,
    rows,
    offs,
    mask,
    key,
    inv_scale,
    FIRST: tl.constexpr,
    GRAD_KIND: tl.constexpr,
    STOCHASTIC_ROUNDING: tl.constexpr,
):
    """Adds the gradient into the blocks `rows` (elements `offs[mask]`, [rows, INT8_BLOCK]) of
    buffer = (codes_ptr, scales_ptr, n_blocks, offset); returns (sum of squares of the stored
    values times inv_scale, 1 if any of those is non-finite else 0)."""
    codes_ptr, scales_ptr, n_blocks, offset = buffer
    row_mask = rows < n_blocks
    new = _load_fp32(grad_ptr, offs, mask, GRAD_KIND)
    if not FIRST:
        old_scale = tl.load(scales_ptr + rows, mask=row_mask, other=0.0)
        old = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.float32) * old_scale[:, None]
        # code * scale is exact: one rounding, fused or not. Outside the buffer the old
        # value is 0 * scale, nan in a non-finite block: zeroed, it stays out of the absmax.
        new = tl.where(mask, old + new, 0.0)
    finite = tl.abs(new) < float("inf")
    absmax = tl.reduce(tl.where(finite, tl.abs(new), 0.0), 1, _MAX)
    bad = tl.reduce((~finite).to(tl.int32), 1, _MAX) > 0
    scale, inverse = power_of_two(absmax)
    x = tl.where(finite, new, 0.0) * inverse[:, None]  # exact: inverse is a power of two
    q = quantised(x, offset + offs, key, STOCHASTIC_ROUNDING)
    # A block holding an inf or nan stores codes 0 and scale nan.
    q = tl.where(bad[:, None], 0.0, q)
    scale = tl.where(bad, float("nan"), scale)
    tl.store(codes_ptr + offs, q.to(tl.int8), mask=mask)
    tl.store(scales_ptr + rows, scale, mask=row_mask)
    # The norm is of what the update will read: code * scale, not the fp32 sum.
    stored = tl.where(mask, q * scale[:, None] * inv_scale, 0.0)
    total = tl.reduce(tl.reduce(stored * stored, 1, _SUM), 0, _SUM)
    return total, _any((~(tl.abs(stored) < float("inf"))).to(tl.int32))


@triton.jit(do_not_specialize=["n", "n_blocks", "offset", "seed_lo", "seed_hi"])
def grad_accumulate_int8_kernel(
    codes_ptr,
    scales_ptr,
    grad_ptr,
    n,
    n_blocks,
    offset,
    lead,
    seed_lo,
    seed_hi,
    inv_scale_ptr,
    sumsq_ptr,
    found_inf_ptr,
    seed_step_ptr,
    FIRST: tl.constexpr,
    GRAD_KIND: tl.constexpr,
    STOCHASTIC_ROUNDING: tl.constexpr,
    ROWS: tl.constexpr,
):
    """codes, scales = quantised(code * scale + g) (FIRST: of g) over ROWS whole blocks per
    program; with `sumsq_ptr`, sumsq += sum((stored * inv_scale) ** 2) with one atomic add
    per program; `found_inf_ptr` raised when a stored value times inv_scale is non-finite.
    `lead` is offset % INT8_BLOCK (specialised: divisible by 16, the accesses are 128-bit)."""
    key = _rounding_key(seed_lo, seed_hi, seed_step_ptr, STOCHASTIC_ROUNDING)
    inv_scale = _factor(inv_scale_ptr)
    buffer = (codes_ptr, scales_ptr, n_blocks, offset.to(tl.int64))
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * _BLOCK + tl.arange(0, _BLOCK)[None, :] - lead
    if pid == tl.num_programs(0) - 1:
        total, bad = _accumulate_blocks(
            buffer, grad_ptr, rows, offs, (offs >= 0) & (offs < n), key, inv_scale,
            FIRST, GRAD_KIND, STOCHASTIC_ROUNDING,
        )  # fmt: skip
    else:
        # Before the last program: only the first block's lead is outside the buffer.
        total, bad = _accumulate_blocks(
            buffer, grad_ptr, rows, offs, offs >= 0, key, inv_scale,
            FIRST, GRAD_KIND, STOCHASTIC_ROUNDING,
        )  # fmt: skip
    if sumsq_ptr is not None:
        tl.atomic_add(sumsq_ptr, total, sem="relaxed")
    if found_inf_ptr is not None:  # noqa: SIM102 (a compile-time branch around a run-time one)
        if bad > 0:
            tl.atomic_max(found_inf_ptr, 1.0)


# ----------------------------------------------------------------------------- reading


@triton.jit
def _row_scales(scales_ptr, rows, lead, n_blocks):
    """[rows, INT8_BLOCK] scales of the parameter-aligned rows `rows` (element j = row *
    INT8_BLOCK + col): block row, or row + 1 from the column where the next block starts."""
    low = tl.load(scales_ptr + rows, mask=rows < n_blocks, other=0.0)
    high = tl.load(scales_ptr + rows + 1, mask=rows + 1 < n_blocks, other=0.0)
    next_block = (tl.arange(0, _BLOCK) + lead >= _BLOCK)[None, :]
    return tl.where(next_block, high[:, None], low[:, None])


@triton.jit
def _element_scales(scales_ptr, offs, mask, lead):
    """The scales of the elements `offs[mask]`, one load each (the tail)."""
    return tl.load(scales_ptr + (offs + lead) // _BLOCK, mask=mask, other=0.0)


@triton.jit
def _values(codes_ptr, scale, offs, mask):
    """fp32 code * scale of the elements `offs[mask]` (exact: the scales are powers of two)."""
    return tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.float32) * scale


@triton.jit
def _update_int8_elements(
    update,
    source,
    scale,
    offs,
    mask,
    offset,
    PARAM_KIND: tl.constexpr,
    HAS_CLIP_VALUE: tl.constexpr,
    HAS_CLIP_COEF: tl.constexpr,
    STOCHASTIC_ROUNDING: tl.constexpr,
):
    """The LOMO step of the parameter elements `offs[mask]` with the gradient code * scale
    (`source`: `grad_source` of the codes), the write-back's bits those of the whole
    parameter's indices offset + offs; returns (int32) where the gradient was non-finite."""
    values = _values(source[0], scale, offs, mask)
    g, finite = _gradient_of(values, source, HAS_CLIP_VALUE, HAS_CLIP_COEF)
    _update_elements(update, g, finite, offs, offset + offs, mask, PARAM_KIND, STOCHASTIC_ROUNDING)
    # Outside the parameter a value is 0 * scale: nan only in a block whose elements inside
    # are nan too, so the flag is the same.
    return (~finite).to(tl.int32)


@triton.jit(do_not_specialize=["n", "n_blocks", "offset", "lead", "seed_lo", "seed_hi"])
def lomo_update_int8_kernel(
    param_ptr,
    codes_ptr,
    scales_ptr,
    n_bulk,
    n,
    n_blocks,
    offset,
    lead,
    weight_decay,
    clip_value,
    seed_lo,
    seed_hi,
    lr_ptr,
    inv_scale_ptr,
    clip_coef_ptr,
    found_inf_ptr,
    skip_if_ptr,
    seed_step_ptr,
    PARAM_KIND: tl.constexpr,
    HAS_CLIP_VALUE: tl.constexpr,
    STOCHASTIC_ROUNDING: tl.constexpr,
    ROWS: tl.constexpr,
):
    """`lomo_update_kernel` (lomo_kernels.py) with the gradient code * scale read from an 8-bit
    blockwise buffer holding the slice at flat `offset` of its parameter (lead = offset %
    INT8_BLOCK); programs of ROWS * INT8_BLOCK elements, the tail in the last."""
    run = tl.load(skip_if_ptr) == 0 if skip_if_ptr is not None else True
    if run:
        lr = tl.load(lr_ptr)
        decay = 1.0 - lr * weight_decay
        source = _grad_source(codes_ptr, inv_scale_ptr, clip_value, clip_coef_ptr)
        key = _rounding_key(seed_lo, seed_hi, seed_step_ptr, STOCHASTIC_ROUNDING)
        update = (param_ptr, lr, decay, key)
        has_clip_coef = clip_coef_ptr is not None
        start = offset.to(tl.int64)
        pid = tl.program_id(0).to(tl.int64)
        rows = pid * ROWS + tl.arange(0, ROWS)
        offs = rows[:, None] * _BLOCK + tl.arange(0, _BLOCK)[None, :]
        scale = _row_scales(scales_ptr, rows, lead, n_blocks)
        bad = _any(_update_int8_elements(
            update, source, scale, offs, offs < n_bulk, start,
            PARAM_KIND, HAS_CLIP_VALUE, has_clip_coef, STOCHASTIC_ROUNDING,
        ))  # fmt: skip
        if pid == tl.num_programs(0) - 1:
            tail = n_bulk.to(tl.int64) + tl.arange(0, 16)
            tail_scale = _element_scales(scales_ptr, tail, tail < n, lead)
            tail_bad = _update_int8_elements(
                update, source, tail_scale, tail, tail < n, start,
                PARAM_KIND, HAS_CLIP_VALUE, has_clip_coef, STOCHASTIC_ROUNDING,
            )  # fmt: skip
            bad = tl.maximum(bad, tl.reduce(tail_bad, 0, _MAX))
        if found_inf_ptr is not None:  # noqa: SIM102 (compile-time branch, see above)
            if bad > 0:
                tl.atomic_max(found_inf_ptr, 1.0)


@triton.jit
def _dequantize_elements(out_ptr, codes_ptr, scale, offs, mask, OUT_KIND: tl.constexpr):
    """out = code * scale in out's type (to nearest even) over `offs[mask]`."""
    value = _values(codes_ptr, scale, offs, mask)
    tl.store(out_ptr + offs, _stored(value, 0, OUT_KIND, False), mask=mask)


@triton.jit(do_not_specialize=["n", "n_blocks", "lead"])
def int8_dequantize_kernel(
    out_ptr,
    codes_ptr,
    scales_ptr,
    n_bulk,
    n,
    n_blocks,
    lead,
    OUT_KIND: tl.constexpr,
    ROWS: tl.constexpr,
):
    """out = code * scale on one flat buffer, tiled as `lomo_update_int8_kernel`."""
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * _BLOCK + tl.arange(0, _BLOCK)[None, :]
    scale = _row_scales(scales_ptr, rows, lead, n_blocks)
    _dequantize_elements(out_ptr, codes_ptr, scale, offs, offs < n_bulk, OUT_KIND)
    if pid == tl.num_programs(0) - 1:
        tail = n_bulk.to(tl.int64) + tl.arange(0, 16)
        tail_scale = _element_scales(scales_ptr, tail, tail < n, lead)
        _dequantize_elements(out_ptr, codes_ptr, tail_scale, tail, tail < n, OUT_KIND)
