"""The LOMO update ops in plain PyTorch: their executable specification, on any device.

Always available. The Triton, C++ and CUDA kernels must produce the same results
(bit-identical rounding rules; fp32 arithmetic may differ by fused multiply-adds). Written
for clarity, not speed: it materialises fp32 temporaries. Runtime scalars are 1-element fp32
device tensors (`scalars.py`); an absent inv_scale or clip_coef means 1.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...core.int8_blocks import (
    INT8_BLOCK,
    INT8_MANTISSA_LIMIT,
    INT8_MAX_CODE,
    INT8_MIN_EXPONENT,
)
from ...core.rounding import Rounding, pair_bits16, round_to_dtype, rounding_key
from ...core.scalars import value_of


def _write_back(
    param: torch.Tensor,
    new: torch.Tensor,
    keep: torch.Tensor,
    stochastic_rounding: bool,
    seed: int,
    seed_step: torch.Tensor | None,
    bits: Callable[[torch.Tensor, int | torch.Tensor], torch.Tensor] | None = None,
    offset: int = 0,
) -> None:
    """Writes fp32 `new` into `param` in its dtype where `keep` is False; stochastic rounding
    draws from `bits(index, key)` (None: the write-back's stream, `Rounding.random16`) at
    the flat indices offset + j of the parameter `param` is a slice of."""
    flat = param.view(-1)
    rounding = Rounding(param.dtype, stochastic_rounding, seed, seed_step)
    random16 = None
    if rounding.stochastic:
        index = offset + torch.arange(flat.numel(), device=param.device, dtype=torch.int64)
        random16 = rounding.random16(index) if bits is None else bits(index, rounding.key)
    flat.copy_(torch.where(keep, flat, round_to_dtype(new, param.dtype, random16)))


def lomo_update_(
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
    offset: int = 0,
) -> None:
    """One LOMO step on one contiguous parameter (or the slice of one at flat `offset`), in
    place.

    g = fp32(grad) * inv_scale; elements with non-finite g leave their parameter unchanged
    and set found_inf; g = clamp(g, -clip_value, clip_value); g *= clip_coef;
    p = p * (1 - lr * weight_decay) - lr * g, rounded back to param.dtype.
    When skip_if is non-zero nothing is written at all. Stochastic rounding draws its bits
    from the key `_rounding.rounding_key(seed, seed_step)` and the element's flat index in
    the whole parameter, offset + j.
    """
    _lomo_step(param, grad.reshape(-1).to(torch.float32), lr, inv_scale, clip_value,
               clip_coef, weight_decay, found_inf, skip_if, stochastic_rounding, seed,
               seed_step, offset)  # fmt: skip


def _lomo_step(
    param: torch.Tensor,
    g: torch.Tensor,
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
    offset: int,
) -> None:
    """`lomo_update_` from the fp32 gradient `g` (flat) of the slice at flat `offset` of its
    parameter (its write-back's bits: `_write_back`'s)."""
    lr_eff = value_of(lr)
    if inv_scale is not None:
        g = g * value_of(inv_scale)
    bad = ~torch.isfinite(g)
    if clip_value is not None:
        g = g.clamp(-clip_value, clip_value)
    if clip_coef is not None:
        g = g * value_of(clip_coef)
    p = param.reshape(-1).to(torch.float32)
    new = p * (1.0 - lr_eff * weight_decay) - lr_eff * g
    keep = bad
    if skip_if is not None:
        keep = keep | (skip_if.reshape(-1)[0] != 0)
    _write_back(param, new, keep, stochastic_rounding, seed, seed_step, offset=offset)
    if found_inf is not None:
        flag = bad.any().to(found_inf.dtype)
        if skip_if is not None:
            flag = torch.where(skip_if.reshape(-1)[0] != 0, torch.zeros_like(flag), flag)
        found_inf.copy_(torch.maximum(found_inf.reshape(-1)[0], flag).reshape(found_inf.shape))


def grad_sumsq_(
    grad: torch.Tensor,
    inv_scale: torch.Tensor | None,
    sumsq: torch.Tensor,
    found_inf: torch.Tensor | None,
) -> None:
    """sumsq += sum((fp32(grad) * inv_scale) ** 2); found_inf = 1 if any element is inf/nan.

    The squares are summed in float64 so the result does not depend on the order in which
    the CPU's BLAS or the GPU's reduction adds them: only the final fp32 roundings remain.
    """
    g = grad.reshape(-1).to(torch.float32)
    if inv_scale is not None:
        g = g * value_of(inv_scale)
    g64 = g.to(torch.float64)
    sumsq.add_(torch.dot(g64, g64).to(sumsq.dtype).reshape(sumsq.shape))
    if found_inf is not None:
        flag = (~torch.isfinite(g)).any().to(found_inf.dtype)
        found_inf.copy_(torch.maximum(found_inf.reshape(-1)[0], flag).reshape(found_inf.shape))


def grad_accumulate_(
    buffer: torch.Tensor,
    grad: torch.Tensor,
    first: bool,
    inv_scale: torch.Tensor | None,
    sumsq: torch.Tensor | None,
    found_inf: torch.Tensor | None,
    stochastic_rounding: bool,
    seed: int,
    seed_step: torch.Tensor | None,
    offset: int = 0,
) -> None:
    """One micro-batch's gradient added into its accumulation buffer (or the slice of one at
    flat `offset` of its parameter, whose bits it draws), in place.

    new = fp32(grad) (first: the buffer's old contents are not read) or fp32(buffer) +
    fp32(grad), stored in the buffer's dtype (to nearest even, or stochastically with the
    accumulation's own stream, `core.rounding.pair_bits16`: one hash per pair of elements);
    found_inf = 1 if any stored value is inf/nan; sumsq += the sum of (stored value *
    inv_scale) ** 2 in float64, as `grad_sumsq_` (the buffer holds the loss-scaled sum, as
    ``.grad`` does under torch's GradScaler; inv_scale unscales the norm only).
    """
    new = grad.reshape(-1).to(torch.float32)
    if not first:
        new = buffer.reshape(-1).to(torch.float32) + new
    _write_back(buffer, new, torch.zeros_like(new, dtype=torch.bool), stochastic_rounding,
                seed, seed_step, pair_bits16, offset)  # fmt: skip
    if sumsq is not None or found_inf is not None:
        if sumsq is None:  # found_inf alone: the sum is measured and dropped
            sumsq = torch.zeros(1, dtype=torch.float32, device=buffer.device)
        grad_sumsq_(buffer, inv_scale, sumsq, found_inf)


# -- the 8-bit blockwise buffer (core/int8_blocks.py) ------------------------------------


def _block_of(offset: int, n: int, device: torch.device) -> torch.Tensor:
    """Each element's block, counted from the buffer's first (partial) block."""
    index = torch.arange(n, device=device, dtype=torch.int64)
    return (offset % INT8_BLOCK + index) // INT8_BLOCK


def int8_dequantized(codes: torch.Tensor, scales: torch.Tensor, offset: int) -> torch.Tensor:
    """The buffer's fp32 values, flat: code * scale (exact: the scales are powers of two)."""
    flat = codes.reshape(-1)
    return flat.to(torch.float32) * scales[_block_of(offset, flat.numel(), codes.device)]


def int8_power_of_two(absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, 1 / scale) of blocks with the finite largest magnitudes `absmax` (fp32): the
    smallest power of two p >= 2**-126 with absmax <= 127 * p, from absmax's bits; scale 0
    (inverse 0) for an all-zero block."""
    bits = absmax.view(torch.int32).to(torch.int64)
    big = ((bits & 0x7FFFFF) > INT8_MANTISSA_LIMIT).to(torch.int64)
    exponent = (((bits >> 23) & 0xFF) - 127 - 6 + big).clamp(min=INT8_MIN_EXPONENT)
    scale = ((exponent + 127) << 23).to(torch.int32).view(torch.float32)
    inverse = ((127 - exponent) << 23).to(torch.int32).view(torch.float32)
    zero = absmax == 0
    return scale.masked_fill(zero, 0.0), inverse.masked_fill(zero, 0.0)


def int8_stochastic_codes(x: torch.Tensor, random16: torch.Tensor) -> torch.Tensor:
    """Stochastic codes of fp32 x = value / scale: x + u rounded to nearest, ties to even,
    the sum one fp32 rounding, with u = (2 r + 1 - 2**16) / 2**17 for r the 16 random bits
    `random16`: an offset uniform on (-1/2, 1/2), centred on 0. x = k + f rounds up with
    probability f rounded to a multiple of 2**-16, within 2**-17 of f (up to 2**-25 more
    for |x| < 1/2, where the fp32 sum can round onto +-1/2); a half-way f (a tie,
    x + u half-way between codes: f an odd multiple of 2**-17, as every such fraction is
    for |x| >= 64) goes to the even code, so ties go up from one code and down from the
    next, 0 on average. (floor(x + r / 2**16) rounds every f down, leaning toward -inf.)"""
    return torch.round(x + (random16 * 2 + 1 - 2**16).to(torch.float32) * 2.0**-17)


def grad_accumulate_int8_(
    codes: torch.Tensor,
    scales: torch.Tensor,
    grad: torch.Tensor,
    offset: int,
    first: bool,
    inv_scale: torch.Tensor | None,
    sumsq: torch.Tensor | None,
    found_inf: torch.Tensor | None,
    stochastic_rounding: bool,
    seed: int,
    seed_step: torch.Tensor | None,
) -> None:
    """One micro-batch's gradient added into an 8-bit blockwise buffer, in place.

    new = fp32(grad) (first: codes and scales are not read) or code * scale + fp32(grad)
    (one fp32 rounding: the product is exact); each block then takes the power-of-two scale
    of its largest |new| and each element the code new / scale rounded to nearest even or
    stochastically with `pair_bits16` at flat index offset + j (`core/int8_blocks.py`); a
    block holding an inf/nan stores codes 0 and scale nan. found_inf = 1 if any stored value
    times inv_scale is inf/nan; sumsq += the sum of (stored value * inv_scale) ** 2, as
    `grad_accumulate_`.
    """
    device = codes.device
    new = grad.reshape(-1).to(torch.float32)
    n = new.numel()
    if not first:
        new = int8_dequantized(codes, scales, offset) + new
    blocks = _block_of(offset, n, device)
    finite = torch.isfinite(new)
    count = scales.numel()
    bad = torch.zeros(count, dtype=torch.int32, device=device)
    bad = bad.index_add_(0, blocks, (~finite).to(torch.int32)) > 0
    magnitude = torch.where(finite, new.abs(), torch.zeros_like(new))
    absmax = torch.zeros(count, dtype=torch.float32, device=device)
    absmax = absmax.scatter_reduce_(0, blocks, magnitude, "amax")
    scale, inverse = int8_power_of_two(absmax)
    x = torch.where(finite, new, torch.zeros_like(new)) * inverse[blocks]  # exact
    if stochastic_rounding:
        key = rounding_key(seed, seed_step)
        index = blocks.new_tensor(offset) + torch.arange(n, device=device)
        q = int8_stochastic_codes(x, pair_bits16(index, key))
    else:
        q = torch.round(x)  # half to even
    q = q.clamp(-INT8_MAX_CODE, INT8_MAX_CODE).masked_fill(bad[blocks], 0.0)
    codes.reshape(-1).copy_(q.to(torch.int8))
    scales.copy_(scale.masked_fill(bad, float("nan")))
    if sumsq is not None or found_inf is not None:
        if sumsq is None:  # found_inf alone: the sum is measured and dropped
            sumsq = torch.zeros(1, dtype=torch.float32, device=device)
        grad_sumsq_(int8_dequantized(codes, scales, offset), inv_scale, sumsq, found_inf)


def lomo_update_int8_(
    param: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    offset: int,
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
) -> None:
    """`lomo_update_` with the gradient read from an 8-bit blockwise buffer (code * scale)
    holding `param`, a slice at flat `offset` of its parameter: the write-back's stochastic
    rounding draws the whole parameter's bits at offset + j, as `lomo_update_`'s."""
    _lomo_step(param, int8_dequantized(codes, scales, offset), lr, inv_scale, clip_value,
               clip_coef, weight_decay, found_inf, skip_if, stochastic_rounding, seed,
               seed_step, offset)  # fmt: skip


def int8_dequantize_(
    out: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offset: int
) -> None:
    """out = code * scale in out's dtype (exact in fp32 and bf16; fp16 to nearest even)."""
    out.reshape(-1).copy_(int8_dequantized(codes, scales, offset).to(out.dtype))
