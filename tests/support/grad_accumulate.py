"""Inputs of `grad_accumulate_` and an independent float64 model of what it stores and measures
(tests/ops/test_grad_accumulate.py, the backend tests in tests/kernels).

The model never calls the package: the fp32 sum the op rounds is formed in float64 (exact for
these inputs) and rounded once to fp32 by torch's cast, and the two neighbours of that value
in the buffer's dtype come from its ulp (support/float64.py), found in float64; the one a
stochastic rounding stores, from the accumulation stream's bits written out here (`sr_model`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np
import torch

from .float64 import ulp

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Each buffer dtype with an fp32 gradient and with a gradient of its own dtype.
PAIRS = [("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "bf16"), ("fp16", "fp32"), ("fp16", "fp16")]
# All nine, for the backends' bit-for-bit checks.
ALL_PAIRS = [(b, g) for b in DTYPES for g in DTYPES]
SR_PAIRS = [(b, g) for b, g in ALL_PAIRS if b != "fp32"]
# 4097 and 278011 are no multiple of 16 (the kernels' bulk/tail split) nor of 8 (the CPU lanes).
SIZES = [1, 7, 4097, 278011]


def make_case(n: int, buffer_dtype: torch.dtype, grad_dtype: torch.dtype, seed: int):
    """(buffer, grad): moderate magnitudes (no overflow, float64 sums exact), with zeros of
    both signs, an exact cancellation and fp16-subnormal gradients among the first elements."""
    gen = torch.Generator().manual_seed(seed)
    buffer = (torch.randn(n, generator=gen) * 3).to(buffer_dtype)
    grad = (torch.randn(n, generator=gen) * 0.7).to(grad_dtype)
    specials = [(0.0, 0.0), (-0.0, -0.0), (-0.0, 0.0), (1.5, -1.5), (0.25, 3e-6), (-2.0, -3e-7)]
    for i, (b, g) in enumerate(specials[:n]):
        buffer[i], grad[i] = b, g
    return buffer, grad


def fp32_sum(buffer: torch.Tensor, grad: torch.Tensor, first: bool) -> torch.Tensor:
    """The op's fp32 value before storing, in float64: fp32(grad), or fp32(buffer) + fp32(grad)
    rounded once to fp32 (the float64 sum of two fp32 values this close in exponent is exact)."""
    g = grad.double().reshape(-1)
    exact = g if first else buffer.double().reshape(-1) + g
    return exact.float().double()


def neighbours(
    x: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(below, above, spacing): the nearest values of `dtype` at or below and at or above the
    finite float64 values x (equal when x is one), and the dtype's spacing there."""
    spacing = ulp(x, dtype)
    return torch.floor(x / spacing) * spacing, torch.ceil(x / spacing) * spacing, spacing


def assert_neighbour(stored: torch.Tensor, x: torch.Tensor) -> None:
    """Every stored value is one of the two neighbours of x in its dtype."""
    below, above, _ = neighbours(x, stored.dtype)
    s = stored.double().reshape(-1)
    ok = (s == below) | (s == above)
    assert bool(ok.all()), f"{int((~ok).sum())} stored values are no neighbour of the sum"


def assert_nearest_even(stored: torch.Tensor, x: torch.Tensor) -> None:
    """Round to nearest even: the nearer neighbour, the one with an even last digit on a tie,
    and the sign of a zero kept."""
    below, above, spacing = neighbours(x, stored.dtype)
    s = stored.double().reshape(-1)
    assert_neighbour(stored, x)
    other = torch.where(s == below, above, below)
    assert bool(((s - x).abs() <= (other - x).abs()).all()), "not the nearer neighbour"
    tie = ((x - below) == (above - x)) & (below != above)
    assert bool((torch.remainder(s / spacing, 2) == 0)[tie].all()), "a tie not rounded to even"
    zero = x == 0
    assert torch.equal(torch.signbit(s)[zero], torch.signbit(x)[zero])


# Stochastic rounding's draws: bf16 adds 16 random bits below its mantissa, fp16 13 (in its
# normal range), so the probability of rounding up is the fraction quantised to 2^-16 or 2^-13
# of a spacing: a bias of at most 2^-13 spacings per element.
SR_QUANTISATION_BIAS = 2.0**-13


def sr_mean_bound(samples: int) -> float:
    """Bound on |mean of (stored - x) / spacing| over independent roundings: each term takes
    -f or 1 - f with mean 0 (unbiased) and variance f(1 - f) <= 1/4, so the mean's standard
    deviation is at most 1 / (2 sqrt(samples)); 6 of those (a chance failure below 2e-9), plus
    the quantisation bias."""
    return 6 * 0.5 / math.sqrt(samples) + SR_QUANTISATION_BIAS


def sr_offsets(stored: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """(stored - x) / spacing, in float64: one term of sr_mean_bound's mean per element."""
    _, _, spacing = neighbours(x, stored.dtype)
    return (stored.double().reshape(-1) - x) / spacing


# The accumulation stream's random bits (core/rounding.py's documented format, written out
# here in numpy's wrapping uint64): the "lowbias32" finaliser, the 64-bit seed and the step
# folded into a 32-bit key, and one hash per pair of elements i and i ^ 16.
_M32 = np.uint64(0xFFFFFFFF)


def _mix32(x: np.ndarray) -> np.ndarray:
    x = x & _M32
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x7FEB352D)) & _M32
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(0x846CA68B)) & _M32
    return x ^ (x >> np.uint64(16))


@functools.cache
def _pair_bits16(n: int, seed: int, step: int, offset: int = 0) -> torch.Tensor:
    """16 bits per flat index i in [offset, offset + n): the key mix32(lo32(seed)) ^
    mix32(hi32(seed) ^ 0x9E3779B9 ^ lo32(step)); with u = lo32(i) ^ key, the hash of u without
    its bit 4 xor lo32(hi32(i) * 0x2545F491), whose low half goes to the element with bit 4
    of u clear and the high half to the other."""
    word = lambda v: np.array([v & 0xFFFFFFFF], dtype=np.uint64)  # noqa: E731
    key = _mix32(word(seed)) ^ _mix32(word((seed >> 32) ^ 0x9E3779B9 ^ step))
    index = np.arange(n, dtype=np.uint64) + np.uint64(offset)
    u = (index & _M32) ^ key
    salt = ((index >> np.uint64(32)) * np.uint64(0x2545F491)) & _M32
    h = _mix32(((u >> np.uint64(5)) << np.uint64(4) | (u & np.uint64(15))) ^ salt)
    bits = np.where(u & np.uint64(16), h >> np.uint64(16), h & np.uint64(0xFFFF))
    return torch.from_numpy(bits.astype(np.float64))


@functools.cache
def element_bits16(n: int, seed: int, step: int, offset: int = 0) -> torch.Tensor:
    """The update's stream: 16 bits per flat index i in [offset, offset + n), the high half of
    mix32(mix32(lo32(i) ^ key) ^ hi32(i)), with `_pair_bits16`'s key."""
    word = lambda v: np.array([v & 0xFFFFFFFF], dtype=np.uint64)  # noqa: E731
    key = _mix32(word(seed)) ^ _mix32(word((seed >> 32) ^ 0x9E3779B9 ^ step))
    index = np.arange(n, dtype=np.uint64) + np.uint64(offset)
    h = _mix32(_mix32((index & _M32) ^ key) ^ (index >> np.uint64(32)))
    return torch.from_numpy((h >> np.uint64(16)).astype(np.float64))


def sr_model(
    x: torch.Tensor,
    dtype: torch.dtype,
    seed: int,
    step: int,
    offset: int = 0,
    stream: Callable[[int, int, int, int], torch.Tensor] = _pair_bits16,
) -> torch.Tensor:
    """The finite fp32 sums x (float64, below fp16's 65504 for fp16) rounded stochastically
    as the accumulation stores them into the slice at flat `offset` of a parameter's buffer,
    with the bits r of `_pair_bits16` at its flat indices (`stream`: `element_bits16` for the
    update's, which rounds its results by the same rule): bf16 rounds the
    magnitude up iff its 16 dropped bits plus r reach 2**16; fp16 in its normal range iff its
    13 dropped bits plus r >> 3 reach 2**13; fp16 below 2**-14 (multiples of 2**-24) iff
    2 r + 1 plus its fraction's 17 bits reach 2**17, a tie (fraction an exact multiple of
    2**-17) going down for odd r. The sign (of a zero too) is kept. Float64 throughout."""
    r = stream(x.numel(), seed, step, offset)
    magnitude = x.abs()
    below, _, spacing = neighbours(magnitude, dtype)  # the magnitude truncated
    dropped = (magnitude - below) / spacing  # in [0, 1), an exact binary fraction
    if dtype == torch.bfloat16:
        up = dropped * 2**16 + r >= 2**16
    else:
        normal = dropped * 2**13 + torch.floor(r / 8) >= 2**13
        scaled = dropped * 2**17
        tie = (scaled == torch.floor(scaled)) & (torch.remainder(r, 2) == 1)
        subnormal = 2 * r + 1 + torch.floor(scaled) - tie.double() >= 2**17
        up = torch.where(magnitude < 2.0**-14, subnormal, normal)
    stored = below + up.double() * spacing
    return torch.where(torch.signbit(x), -stored, stored)


def sumsq_model(stored: torch.Tensor, inv_scale: float, start: float) -> float:
    """start + sum((stored * inv_scale) ** 2): each product rounded to fp32, as the op forms
    it, squared exactly and summed in float64 (relative error ~n * 2^-53, negligible)."""
    scaled = stored.float().reshape(-1) * torch.tensor(inv_scale, dtype=torch.float32)
    return start + (scaled.double() ** 2).sum().item()


def accumulate_both(
    module,
    buffer: torch.Tensor,
    grad: torch.Tensor,
    *,
    first: bool = False,
    inv_scale: torch.Tensor | None = None,
    sr: bool = False,
    seed: int = 0,
    seed_step: torch.Tensor | None = None,
    start: float = 0.75,
    squares: bool = True,
    offset: int = 0,
) -> tuple[tuple, tuple, tuple]:
    """`module.grad_accumulate_` (a backend) and the reference's on copies of `buffer` (the
    slice at flat `offset` of its parameter), each with sumsq (from `start`; None without
    `squares`: the flag alone) and found_inf: ((buffers), (sumsqs), (flags)), backend first."""
    from lomo_kernels.ops.lomo import reference

    buffers, sums, flags = [], [], []
    for m in (module, reference):
        out, sumsq, found = buffer.clone(), torch.tensor([start]), torch.zeros(1)
        measured = sumsq if squares else None
        m.grad_accumulate_(
            out, grad, first, inv_scale, measured, found, sr, seed, seed_step, offset
        )
        buffers.append(out)
        sums.append(sumsq)
        flags.append(found)
    return tuple(buffers), tuple(sums), tuple(flags)


def assert_same_stored(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-identical but for nan payloads: a nan summed from an fp16 input carries what the
    fp16 -> fp32 conversion gives it (IEEE's in the kernels, torch's own varies), so nans only
    have to sit at the same places (the bf16 quiet-nan rule: the update's bitwise tests)."""
    from .lomo_bitwise import assert_same_bits

    nan = float("nan")
    assert_same_bits(got.masked_fill(got.isnan(), nan), want.masked_fill(want.isnan(), nan))


def roundings(buffer_dtype: str) -> tuple[bool, ...]:
    """The stochastic_rounding values a buffer of that dtype (a DTYPES key) takes."""
    return (False,) if buffer_dtype == "fp32" else (False, True)
