"""Bit-exact rounding helpers shared by every backend's reference semantics.

The Triton interpreter truncates fp32 -> bf16 casts while GPUs round to nearest even, so
every backend rounds explicitly on the fp32 bit pattern. These torch versions define the
exact bits the Triton, C++ and CUDA kernels must produce.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
_HASH_MUL_1 = 0x7FEB352D
_HASH_MUL_2 = 0x846CA68B
_SEED_SALT = 0x9E3779B9


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2**32 for int64 tensors holding uint32 values, without int64 overflow."""
    lo = constant & 0xFFFF
    hi = constant >> 16
    return (x * lo + ((x * hi) << 16)) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """32-bit integer finaliser ("lowbias32"), a bijection; int64 tensors holding uint32."""
    x = x ^ (x >> 16)
    x = _mul32(x, _HASH_MUL_1)
    x = x ^ (x >> 15)
    x = _mul32(x, _HASH_MUL_2)
    return x ^ (x >> 16)


def mix32_int(x: int) -> int:
    """The same finaliser on a Python int (used on the host to derive a per-call key)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * _HASH_MUL_1) & MASK32
    x ^= x >> 15
    x = (x * _HASH_MUL_2) & MASK32
    return x ^ (x >> 16)


def seed_parts(seed: int) -> tuple[int, int]:
    """The host's share of a 64-bit seed's rounding key: (mix32(lo32(seed)), hi32(seed) ^ salt).

    The key is ``parts[0] ^ mix32(parts[1] ^ step)``, with `step` a per-step value (0 when
    absent): only the second half depends on it, so a kernel can read the step from device
    memory and finish the key itself, and a compiled graph does not depend on the step.
    """
    seed &= (1 << 64) - 1
    return mix32_int(seed & MASK32), (seed >> 32) ^ _SEED_SALT


def seed_key(seed: int, step: int = 0) -> int:
    """Folds a 64-bit seed into the 32-bit rounding key; the low 32 bits of `step` are XORed
    into the seed's high half (``seed_key(s, t) == seed_key(s ^ (t << 32))`` for t < 2**32)."""
    lo_mix, hi = seed_parts(seed)
    return lo_mix ^ mix32_int(hi ^ step)


def rounding_key(seed: int, seed_step: torch.Tensor | None) -> int | torch.Tensor:
    """`seed_key(seed, step)` with the step the value of a 1-element int64 tensor, computed on
    that tensor's device (a 1-element int64 tensor, no host read); `seed_key(seed)` without."""
    if seed_step is None:
        return seed_key(seed)
    lo_mix, hi = seed_parts(seed)
    step = seed_step.reshape(-1)[:1].to(torch.int64) & MASK32
    return lo_mix ^ mix32(hi ^ step)


def random_bits16(index: torch.Tensor, key: int | torch.Tensor) -> torch.Tensor:
    """16 random bits per flat element index: mix32(mix32(lo32(i) ^ key) ^ hi32(i)) >> 16."""
    lo = index & MASK32
    hi = index >> 32
    return mix32(mix32(lo ^ key) ^ hi) >> 16


# Odd multiplier folding an index's high 32 bits into the accumulation's hash input.
_PAIR_HI_MUL = 0x2545F491


def pair_bits16(index: torch.Tensor, key: int | torch.Tensor) -> torch.Tensor:
    """16 random bits per flat element index from one 32-bit hash per pair of elements (the
    accumulation's stream). Elements ``i`` and ``i ^ 16`` (16 apart in an aligned block of
    32) are a pair: with ``u = lo32(i) ^ key``, their hash is ``mix32(v ^ lo32(hi32(i) *
    _PAIR_HI_MUL))`` with ``v`` the bits of ``u`` but bit 4 (``(u >> 5) << 4 | u & 15``), and
    the one with bit 4 of ``u`` clear takes the low half, the other the high half. (A vector
    of 16 hashes then serves 32 consecutive elements from a multiple of 32 without moving a
    half across lanes.)"""
    lo = index & MASK32
    hi = index >> 32
    u = lo ^ key
    h = mix32(((u >> 5) << 4 | (u & 15)) ^ _mul32(hi, _PAIR_HI_MUL))
    return torch.where((u & 16) != 0, h >> 16, h & 0xFFFF)


def fp32_to_bf16_bits(value: torch.Tensor, random16: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 bit patterns (int64 in [0, 65535]) of fp32 `value`.

    Round to nearest even, or stochastically when `random16` (uniform 16-bit integers) is
    given: add them below the kept bits and truncate. NaN stays a quiet NaN; inf stays inf.
    """
    bits = value.contiguous().view(torch.int32).to(torch.int64) & MASK32
    is_nan = torch.isnan(value)
    if random16 is None:
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    else:
        is_inf = torch.isinf(value)
        rounded = torch.where(is_inf, bits >> 16, (bits + random16) >> 16)
    rounded = torch.where(is_nan, (bits >> 16) | 0x0040, rounded)
    return rounded & 0xFFFF


def bf16_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """bf16 tensor whose bit patterns are `bits` (int64 in [0, 65535])."""
    signed = torch.where(bits >= 0x8000, bits - 0x10000, bits)
    return signed.to(torch.int16).view(torch.bfloat16)


# fp32 bit patterns (magnitudes) of fp16's smallest normal (2^-14) and largest finite (65504).
FP16_MIN_NORMAL_BITS = 0x38800000
FP16_MAX_BITS = 0x477FE000


def fp16_stochastic(value: torch.Tensor, random16: torch.Tensor) -> torch.Tensor:
    """fp32 `value` rounded stochastically onto the fp16 grid (returned as fp32 holding an
    exactly representable fp16 value), with `random16` uniform 16-bit integers per element.

    Normal range (2^-14 <= |x| <= 65504): fp16 keeps the top 10 of fp32's 23 mantissa bits,
    so ``random16 >> 3`` (13 bits) is added to the magnitude's bit pattern and the low 13
    bits cleared: up with probability exactly (dropped bits) / 2^13. Subnormal range: the
    grid is multiples of 2^-24; ``q = |x| * 2^24`` (exact) rounds up iff
    ``frac(q) + (2 random16 + 1) / 2^17 >= 1``, i.e. ``2 random16 + 1 + floor(frac(q) *
    2^17) >= 2^17``, but a tie (equality, frac(q) an odd multiple of 2^-17) rounds down
    for odd random16: the random value centred in its 2^-16 cell, so the probability is
    frac(q) rounded to a multiple of 2^-16, the ties alternating from cell to cell (within
    2^-17 of frac(q), 0 on average over fractions, as the 8-bit buffer's codes). Beyond
    65504, inf and nan: the nearest cast's result (65504 up to 65520, inf above, nan stays
    nan). The sign is kept (-0.0 too).
    """
    bits = value.contiguous().view(torch.int32).to(torch.int64) & MASK32
    sign = bits & 0x80000000
    mag = bits & 0x7FFFFFFF
    normal = (mag + (random16 >> 3)) & ~0x1FFF
    q = value.abs() * 2.0**24
    whole = torch.floor(q)
    scaled = (q - whole) * 131072.0
    frac17 = torch.floor(scaled)
    tie = (frac17 == scaled) & (random16 % 2 == 1)  # a sum of exactly 2^17 goes down
    total = 2 * random16 + 1 + frac17.to(torch.int64) - tie.to(torch.int64)
    up = (total >= 131072).to(torch.float32)
    small = ((whole + up) * 2.0**-24).view(torch.int32).to(torch.int64) & MASK32
    rounded_mag = torch.where(mag < FP16_MIN_NORMAL_BITS, small, normal)
    out = (rounded_mag | sign).to(torch.int32).view(torch.float32).view(value.shape)
    return torch.where(mag > FP16_MAX_BITS, value, out)


def round_to_dtype(
    value: torch.Tensor, dtype: torch.dtype, random16: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 `value` stored in `dtype` as the kernels store it: bf16 rounded on the bit pattern,
    fp16 by the cast; both stochastically when `random16` (uniform 16-bit integers) is given
    (`fp32_to_bf16_bits`, `fp16_stochastic`). fp32 is returned as it is."""
    if dtype == torch.bfloat16:
        return bf16_from_bits(fp32_to_bf16_bits(value, random16)).view(value.shape)
    if dtype == torch.float16 and random16 is not None:
        return fp16_stochastic(value, random16).to(dtype)
    return value.to(dtype)


def rounds_stochastically(dtype: torch.dtype) -> bool:
    """Whether stochastic rounding applies to parameters of `dtype` (the low-precision ones)."""
    return dtype in (torch.bfloat16, torch.float16)


def check_stochastic_rounding(stored: torch.Tensor, stochastic: bool, what: str) -> None:
    """Refuses stochastic rounding of a tensor (`what`: 'parameter', 'buffer') whose dtype
    stores fp32 values exactly."""
    if stochastic and not rounds_stochastically(stored.dtype):
        raise ValueError(
            f"lomo_kernels: stochastic_rounding applies to bfloat16 and float16 {what}s (a "
            f"{stored.dtype} {what} stores fp32 values exactly): pass stochastic_rounding=False"
        )


class Rounding:
    """How a write-back rounds fp32 results into the parameter's dtype: to nearest even, or
    stochastically (bf16 and fp16 parameters) with 16 bits per element drawn from the key
    `rounding_key(seed, seed_step)` and the element's flat index in the whole parameter, so
    a tile, a block or another rank's slice rounds as the whole tensor would."""

    def __init__(
        self,
        dtype: torch.dtype,
        stochastic_rounding: bool,
        seed: int,
        seed_step: torch.Tensor | None,
    ) -> None:
        self.stochastic = stochastic_rounding and rounds_stochastically(dtype)
        self.key = rounding_key(seed, seed_step) if self.stochastic else 0

    def random16(self, index: torch.Tensor) -> torch.Tensor | None:
        """The bits for elements at flat `index` (int64), or None to round to nearest."""
        return random_bits16(index, self.key) if self.stochastic else None


NEAREST = Rounding(torch.float32, False, 0, None)
