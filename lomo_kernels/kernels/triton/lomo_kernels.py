"""Fused LOMO update, gradient sum of squares and gradient accumulation: the Triton device
code (launchers: `ops/lomo/triton_backend.py`).

Each kernel makes one pass over one contiguous parameter. The numel n is split into an
aligned bulk of `n - n % 16` elements, masked with a bound the JIT specialises as divisible
by 16 (so loads and stores are 128-bit wide), and a tail of fewer than 16 elements handled
by the last program. Loads and roundings are `rounding_kernels.py`'s: bf16 values travel as
int16 bit patterns and are rounded with integer operations, fp16 is rounded stochastically
on the fp32 bits, so the interpreter and the GPU write identical bits (see `core/rounding.py`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...core.torch_internals import triton_reduce_combines
from .runtime import interpret_mode, kernels

# tl.max / tl.sum are @triton.jit functions decorated for the mode active when triton was
# first imported, so they break the interpreter if TRITON_INTERPRET was set later. The
# builtin tl.reduce with their combine functions compiles to the same code and is
# recognised by the interpreter in either case.
_MAX, _SUM = triton_reduce_combines()


# triton.jit picks interpreter or compiler when a kernel is decorated (runtime.kernels).
DECORATED_FOR_INTERPRETER = interpret_mode()
# The shared loads, gradient, hash and roundings, decorated for the same mode as this module.
_shared = kernels("rounding_kernels")
_rounding_key, _to_fp32, _to_storage = _shared.rounding_key, _shared.to_fp32, _shared.to_storage
_to_accumulated = _shared.to_accumulated
_load_fp32 = _shared.load_fp32
_factor, _grad_source, _scaled, _grad = (
    _shared.factor,
    _shared.grad_source,
    _shared.scaled_grad,
    _shared.gradient,
)


# ----------------------------------------------------------------------------- device code


@triton.jit
def update_elements(
    update,
    g,
    finite,
    offs,
    index,
    mask,
    PARAM_KIND: tl.constexpr,
    STOCHASTIC_ROUNDING: tl.constexpr,
):
    """The LOMO step of the parameter elements `offs[mask]` of update = (param_ptr, lr, decay,
    rounding key) with the fp32 gradient `g` (`rounding_kernels.gradient`), where `finite`;
    stochastic rounding draws the bits of the flat indices `index` (int64)."""
    param_ptr, lr, decay, key = update
    raw = tl.load(param_ptr + offs, mask=mask, other=0)
    new = _to_fp32(raw, PARAM_KIND) * decay - lr * g
    out = _to_storage(new, index, key, PARAM_KIND, STOCHASTIC_ROUNDING)
    # Rewriting the old bits instead of masking them out keeps the store mask uniform
    # over 16 elements, which the 128-bit stores need.
    tl.store(param_ptr + offs, tl.where(finite, out, raw), mask=mask)


@triton.jit
def _update_chunk(
    update,
    source,
    offs,
    offset,
    mask,
    PARAM_KIND: tl.constexpr,
    GRAD_KIND: tl.constexpr,
    HAS_CLIP_VALUE: tl.constexpr,
    HAS_CLIP_COEF: tl.constexpr,
    STOCHASTIC_ROUNDING: tl.constexpr,
):
    """Updates the elements `offs[mask]` with the gradient of `source`
    (`rounding_kernels.grad_source`), rounding them as the parameter's flat indices
    offset + offs; returns 1 if any gradient was non-finite, else 0."""
    g, finite = _grad(source, offs, mask, GRAD_KIND, HAS_CLIP_VALUE, HAS_CLIP_COEF)
    index = offset + offs
    update_elements(update, g, finite, offs, index, mask, PARAM_KIND, STOCHASTIC_ROUNDING)
    return tl.reduce((~finite).to(tl.int32), 0, _MAX)


@triton.jit(do_not_specialize=["n", "offset", "seed_lo", "seed_hi"])
def lomo_update_kernel(
    param_ptr,
    grad_ptr,
    n_bulk,
    n,
    offset,
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
    GRAD_KIND: tl.constexpr,
    HAS_CLIP_VALUE: tl.constexpr,
    STOCHASTIC_ROUNDING: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """p = p * (1 - lr * wd) - lr * clip(g * inv_scale) * clip_coef on one flat parameter.

    The runtime scalars are read from device memory. An `inv_scale_ptr`, `clip_coef_ptr`,
    `found_inf_ptr`, `skip_if_ptr` or `seed_step_ptr` that is None selects the code path
    without it (None arguments are compile-time constants). Stochastic rounding's key is
    `seed_lo ^ mix32(seed_hi ^ step)` (`_rounding.seed_parts`), the step read here; its
    bits are those of the flat indices offset + j (`param_ptr` a slice at `offset` of its
    parameter).
    """
    run = tl.load(skip_if_ptr) == 0 if skip_if_ptr is not None else True
    if run:
        lr = tl.load(lr_ptr)
        decay = 1.0 - lr * weight_decay
        source = _grad_source(grad_ptr, inv_scale_ptr, clip_value, clip_coef_ptr)
        key = _rounding_key(seed_lo, seed_hi, seed_step_ptr, STOCHASTIC_ROUNDING)
        update = (param_ptr, lr, decay, key)
        has_clip_coef = clip_coef_ptr is not None
        pid = tl.program_id(0).to(tl.int64)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        start = offset.to(tl.int64)
        bad = _update_chunk(
            update, source, offs, start, offs < n_bulk,
            PARAM_KIND, GRAD_KIND, HAS_CLIP_VALUE, has_clip_coef, STOCHASTIC_ROUNDING,
        )  # fmt: skip
        if pid == tl.num_programs(0) - 1:
            tail = n_bulk.to(tl.int64) + tl.arange(0, 16)
            tail_bad = _update_chunk(
                update, source, tail, start, tail < n,
                PARAM_KIND, GRAD_KIND, HAS_CLIP_VALUE, has_clip_coef, STOCHASTIC_ROUNDING,
            )  # fmt: skip
            bad = tl.maximum(bad, tail_bad)
        # A compile-time branch around a run-time one; `and` would compile both sides.
        if found_inf_ptr is not None:  # noqa: SIM102
            if bad > 0:
                tl.atomic_max(found_inf_ptr, 1.0)


@triton.jit
def _sumsq_chunk(grad_ptr, offs, mask, inv_scale, GRAD_KIND: tl.constexpr):
    """(sum of squares, 1 if any non-finite else 0) of the scaled gradient over `offs[mask]`."""
    g, finite = _scaled(grad_ptr, inv_scale, offs, mask, GRAD_KIND)
    bad = tl.reduce((~finite).to(tl.int32), 0, _MAX)
    return tl.reduce(g * g, 0, _SUM), bad


@triton.jit(do_not_specialize=["n"])
def grad_sumsq_kernel(
    grad_ptr,
    n_bulk,
    n,
    inv_scale_ptr,
    sumsq_ptr,
    found_inf_ptr,
    GRAD_KIND: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """sumsq += sum((g * inv_scale) ** 2) with one atomic add per program."""
    inv_scale = _factor(inv_scale_ptr)
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


@triton.jit
def _accumulate_chunk(
    buffer_ptr,
    grad_ptr,
    offs,
    offset,
    mask,
    key,
    inv_scale,
    FIRST: tl.constexpr,
    BUFFER_KIND: tl.constexpr,
    GRAD_KIND: tl.constexpr,
    STOCHASTIC_ROUNDING: tl.constexpr,
):
    """Adds the gradient into the buffer over `offs[mask]` (stochastic rounding: the
    accumulation's stream, `rounding_kernels.pair_random16`, at the parameter's flat
    indices offset + offs); returns (sum of squares of the stored values times inv_scale,
    1 if any of those is non-finite else 0)."""
    new = _load_fp32(grad_ptr, offs, mask, GRAD_KIND)
    if not FIRST:
        new += _load_fp32(buffer_ptr, offs, mask, BUFFER_KIND)
    out = _to_accumulated(new, offset + offs, key, BUFFER_KIND, STOCHASTIC_ROUNDING)
    tl.store(buffer_ptr + offs, out, mask=mask)
    # The norm is of what the update will read: the stored value, not the fp32 sum.
    stored = _to_fp32(out, BUFFER_KIND) * inv_scale
    stored = tl.where(mask, stored, 0.0)
    bad = tl.reduce((~(tl.abs(stored) < float("inf"))).to(tl.int32), 0, _MAX)
    return tl.reduce(stored * stored, 0, _SUM), bad


@triton.jit(do_not_specialize=["n", "offset", "seed_lo", "seed_hi"])
def grad_accumulate_kernel(
    buffer_ptr,
    grad_ptr,
    n_bulk,
    n,
    offset,
    seed_lo,
    seed_hi,
    inv_scale_ptr,
    sumsq_ptr,
    found_inf_ptr,
    seed_step_ptr,
    FIRST: tl.constexpr,
    BUFFER_KIND: tl.constexpr,
    GRAD_KIND: tl.constexpr,
    STOCHASTIC_ROUNDING: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """buffer = round(buffer + g) (FIRST: round(g)) on one flat buffer; with `sumsq_ptr`,
    sumsq += sum((stored * inv_scale) ** 2) with one atomic add per program; `found_inf_ptr`
    raised when a stored value is non-finite. `buffer_ptr` holds the slice at flat `offset`
    of its parameter, whose bits it draws."""
    key = _rounding_key(seed_lo, seed_hi, seed_step_ptr, STOCHASTIC_ROUNDING)
    inv_scale = _factor(inv_scale_ptr)
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    start = offset.to(tl.int64)
    total, bad = _accumulate_chunk(
        buffer_ptr, grad_ptr, offs, start, offs < n_bulk, key, inv_scale,
        FIRST, BUFFER_KIND, GRAD_KIND, STOCHASTIC_ROUNDING,
    )  # fmt: skip
    if pid == tl.num_programs(0) - 1:
        tail = n_bulk.to(tl.int64) + tl.arange(0, 16)
        tail_total, tail_bad = _accumulate_chunk(
            buffer_ptr, grad_ptr, tail, start, tail < n, key, inv_scale,
            FIRST, BUFFER_KIND, GRAD_KIND, STOCHASTIC_ROUNDING,
        )  # fmt: skip
        total += tail_total
        bad = tl.maximum(bad, tail_bad)
    if sumsq_ptr is not None:
        tl.atomic_add(sumsq_ptr, total, sem="relaxed")
    if found_inf_ptr is not None:  # noqa: SIM102 (compile-time branch, see above)
        if bad > 0:
            tl.atomic_max(found_inf_ptr, 1.0)
