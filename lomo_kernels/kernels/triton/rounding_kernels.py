"""Loading parameters and gradients as fp32 and rounding fp32 results into their storage type:
the Triton device functions every kernel module shares (`lomo_kernels.py`, `adalomo_kernels.py`,
`linear_cross_entropy_kernels.py`), so there is one definition of each load, of the gradient's
scaling and clipping, of the hash and of each rounding. The bits are `core/rounding.py`'s.

bf16 travels as int16 bit patterns and is rounded with integer operations (the interpreter's
fp32 -> bf16 cast truncates while GPUs round to nearest even). fp16 is rounded stochastically
on the fp32 bits onto an fp32 value the fp16 grid holds exactly, so the final cast is exact
on both (the nearest cast only decides values beyond 65504, inf and nan, as the reference's).

Kernel modules take these through `runtime.kernels("rounding_kernels")`, which re-imports
this module when it was decorated for the other mode (interpreter or compiler).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...core import rounding as _rounding
from .runtime import interpret_mode

# Kind codes of the element types (runtime.KIND).
FP32, FP16, BF16 = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)

_MUL_1 = tl.constexpr(_rounding._HASH_MUL_1)
_MUL_2 = tl.constexpr(_rounding._HASH_MUL_2)
_PAIR_HI_MUL = tl.constexpr(_rounding._PAIR_HI_MUL)
# fp32 magnitude bits of fp16's smallest normal (2^-14) and largest finite value (65504).
_FP16_MIN_NORMAL_BITS = tl.constexpr(_rounding.FP16_MIN_NORMAL_BITS)
_FP16_MAX_BITS = tl.constexpr(_rounding.FP16_MAX_BITS)
# 2^24 and 2^-24: fp16's subnormal grid step is 2^-24.
_TWO_POW_24 = tl.constexpr(16777216.0)
_TWO_POW_M24 = tl.constexpr(2.0**-24)

# triton.jit picks interpreter or compiler when a function is decorated (runtime.kernels).
DECORATED_FOR_INTERPRETER = interpret_mode()


@triton.jit
def mix32(x):
    """lowbias32 finaliser on uint32 (wrapping multiplies), as `_rounding.mix32`."""
    x ^= x >> 16
    x *= _MUL_1
    x ^= x >> 15
    x *= _MUL_2
    x ^= x >> 16
    return x


@triton.jit
def rounding_key(seed_lo, seed_hi, seed_step_ptr, STOCHASTIC_ROUNDING: tl.constexpr):
    """The uint32 key of stochastic rounding: ``seed_lo ^ mix32(seed_hi ^ lo32(step))``
    (`core.rounding.seed_parts`, int32 bits of the two uint32 halves), the per-step value read
    from device memory here (`seed_step_ptr` None: no per-step value, step 0). Without
    stochastic rounding the key is unused and costs nothing."""
    key = seed_lo.to(tl.uint32, bitcast=True)
    if STOCHASTIC_ROUNDING:
        hi = seed_hi.to(tl.uint32, bitcast=True)
        if seed_step_ptr is not None:
            hi ^= (tl.load(seed_step_ptr) & 0xFFFFFFFF).to(tl.uint32)
        key ^= mix32(hi)
    return key


@triton.jit
def random16(offs, key):
    """16 random bits (uint32) per int64 flat element index: `_rounding.random_bits16`."""
    lo = offs.to(tl.uint32)
    hi = (offs >> 32).to(tl.uint32)
    return mix32(mix32(lo ^ key) ^ hi) >> 16


@triton.jit
def pair_random16(offs, key):
    """16 random bits (uint32) per int64 flat element index from one hash per pair of
    elements (``i``, ``i ^ 16``): `_rounding.pair_bits16`, the accumulation's stream."""
    lo = offs.to(tl.uint32)
    hi = (offs >> 32).to(tl.uint32)
    u = lo ^ key
    h = mix32((((u >> 5) << 4) | (u & 15)) ^ (hi * _PAIR_HI_MUL))
    return tl.where((u & 16) != 0, h >> 16, h & 0xFFFF)


@triton.jit
def to_fp32(raw, KIND: tl.constexpr):
    """fp32 values of loaded storage values (bf16 as int16 bits)."""
    if KIND == BF16:
        # bf16 bits are the top half of the fp32 bits: exact, no cast.
        return (raw.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return raw.to(tl.float32)


@triton.jit
def load_fp32(ptr, offs, mask, KIND: tl.constexpr):
    """fp32 values of a 0 = fp32, 1 = fp16, 2 = bf16 (as int16 bits) tensor."""
    return to_fp32(tl.load(ptr + offs, mask=mask, other=0), KIND)


@triton.jit
def factor(ptr):
    """An optional runtime factor: its device value, or 1 without one (None is a
    compile-time constant)."""
    value = 1.0
    if ptr is not None:
        value = tl.load(ptr)
    return value


@triton.jit
def grad_source(grad_ptr, inv_scale_ptr, clip_value, clip_coef_ptr):
    """The gradient with its scalars read once: (ptr, inv_scale, clip_value, clip_coef)."""
    return grad_ptr, factor(inv_scale_ptr), clip_value, factor(clip_coef_ptr)


@triton.jit
def scaled(values, inv_scale):
    """(h, finite): h = fp32 gradient values * inv_scale and whether it is finite."""
    h = values * inv_scale
    return h, tl.abs(h) < float("inf")


@triton.jit
def scaled_grad(grad_ptr, inv_scale, offs, mask, GRAD_KIND: tl.constexpr):
    """(h, finite): h = grad * inv_scale in fp32 and whether it is finite."""
    return scaled(load_fp32(grad_ptr, offs, mask, GRAD_KIND), inv_scale)


@triton.jit
def clamp(h, clip_value, HAS_CLIP_VALUE: tl.constexpr):
    """h clamped to +-clip_value when clipping by value is on."""
    if HAS_CLIP_VALUE:
        h = tl.minimum(tl.maximum(h, -clip_value), clip_value)
    return h


@triton.jit
def gradient(
    source,
    offs,
    mask,
    GRAD_KIND: tl.constexpr,
    HAS_CLIP_VALUE: tl.constexpr,
    HAS_CLIP_COEF: tl.constexpr,
):
    """(g, finite): the fp32 gradient of the math (`grad_source`'s, scaled, clamped, times
    the clip coefficient) and whether grad * inv_scale is finite."""
    values = load_fp32(source[0], offs, mask, GRAD_KIND)
    return gradient_of(values, source, HAS_CLIP_VALUE, HAS_CLIP_COEF)


@triton.jit
def gradient_of(
    values,
    source,
    HAS_CLIP_VALUE: tl.constexpr,
    HAS_CLIP_COEF: tl.constexpr,
):
    """`gradient` of fp32 gradient values already formed (`source`'s pointer unread)."""
    _, inv_scale, clip_value, clip_coef = source
    h, finite = scaled(values, inv_scale)
    g = clamp(h, clip_value, HAS_CLIP_VALUE)
    if HAS_CLIP_COEF:
        g = g * clip_coef
    return g, finite


@triton.jit
def bf16_bits(value, noise, STOCHASTIC_ROUNDING: tl.constexpr):
    """int16 bf16 bits of fp32 `value` per `_rounding.fp32_to_bf16_bits`: nearest even, or
    `noise` (16 random bits) added below the kept bits; NaN stays a quiet NaN."""
    bits = value.to(tl.uint32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    if STOCHASTIC_ROUNDING:  # noqa: SIM108 (a compile-time branch, commented per side)
        # inf has 16 zero low bits, so adding noise cannot carry: it stays inf.
        rounded = (bits + noise) >> 16
    else:
        # Round to nearest even; wraps only for NaN patterns, replaced below.
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(magnitude > 0x7F800000, (bits >> 16) | 0x40, rounded)
    return rounded.to(tl.int16)


@triton.jit
def fp16_stochastic(value, noise):
    """fp32 `value` rounded stochastically onto the fp16 grid, as fp32 (`core.rounding.
    fp16_stochastic`): ``noise >> 3`` added to the magnitude bits and 13 bits cleared in the
    normal range; below 2^-14 up iff ``2 noise + 1 + floor(frac(|x| * 2^24) * 2^17) >= 2^17``
    on the 2^-24 grid, a tie (equality, the fraction exact in 17 bits) down for odd noise;
    beyond 65504, inf and nan `value` itself (the cast rounds it)."""
    bits = value.to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000
    magnitude = bits & 0x7FFFFFFF
    normal = (magnitude + (noise >> 3)) & 0xFFFFE000
    # Subnormal range only (others read 0, so no inf or nan enters the float math): every
    # step is exact, q < 2^10 and (whole + up) * 2^-24 an fp32 normal.
    tiny = tl.where(magnitude < _FP16_MIN_NORMAL_BITS, magnitude, 0).to(tl.float32, bitcast=True)
    q = tiny * _TWO_POW_24
    whole = tl.floor(q)
    scaled = (q - whole) * 131072.0
    frac17 = scaled.to(tl.uint32)  # truncation is floor: q - whole >= 0
    tie = ((frac17.to(tl.float32) == scaled) & ((noise & 1) != 0)).to(tl.uint32)
    up = (noise * 2 + 1 + frac17 - tie >= 131072).to(tl.float32)
    small = ((whole + up) * _TWO_POW_M24).to(tl.uint32, bitcast=True)
    rounded = (tl.where(magnitude < _FP16_MIN_NORMAL_BITS, small, normal) | sign).to(
        tl.float32, bitcast=True
    )
    return tl.where(magnitude > _FP16_MAX_BITS, value, rounded)


@triton.jit
def stored(value, noise, KIND: tl.constexpr, STOCHASTIC_ROUNDING: tl.constexpr):
    """fp32 `value` in the storage type (bf16 as int16 bits): round to nearest even, or (bf16,
    fp16) stochastically with `noise` (16 random bits per element)."""
    if KIND == FP32:
        return value
    elif KIND == FP16:
        if STOCHASTIC_ROUNDING:
            value = fp16_stochastic(value, noise)
        return value.to(tl.float16)
    else:
        return bf16_bits(value, noise, STOCHASTIC_ROUNDING)


@triton.jit
def to_storage(value, offs, key, KIND: tl.constexpr, STOCHASTIC_ROUNDING: tl.constexpr):
    """fp32 `value` in the parameter's storage type (bf16 as int16 bits): round to nearest
    even, or (bf16, fp16) stochastically with the 16 bits of the flat indices `offs` (int64)
    under `key` (`rounding_key`)."""
    noise = 0
    if STOCHASTIC_ROUNDING:  # noqa: SIM102 (compile-time branches)
        if KIND != FP32:
            noise = random16(offs, key)
    return stored(value, noise, KIND, STOCHASTIC_ROUNDING)


@triton.jit
def to_accumulated(value, offs, key, KIND: tl.constexpr, STOCHASTIC_ROUNDING: tl.constexpr):
    """`to_storage` with the accumulation's bits (`pair_random16`)."""
    noise = 0
    if STOCHASTIC_ROUNDING:  # noqa: SIM102 (compile-time branches)
        if KIND != FP32:
            noise = pair_random16(offs, key)
    return stored(value, noise, KIND, STOCHASTIC_ROUNDING)
