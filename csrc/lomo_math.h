// Per-element LOMO math shared by the CPU (lomo_cpu.cpp) and CUDA (lomo_cuda.cu) kernels.
//
// The executable specification is lomo_kernels/ops/lomo/reference.py together with
// lomo_kernels/core/rounding.py; every rule below reproduces those bit for bit:
//   * fp32 arithmetic is rounded after every operation, in the reference's order (no fused
//     multiply-add), so results match the per-op PyTorch reference exactly. Host builds must
//     use -ffp-contract=off; device code uses the explicit _rn intrinsics.
//   * fp32 -> bf16 rounds on the bit pattern (nearest even, or stochastic with a hash).
//   * fp16 conversions are exact IEEE (round to nearest even, subnormals kept); stochastic
//     rounding onto the fp16 grid is _rounding.fp16_stochastic.
//
// No torch headers here: nvcc compiles this alone.
#pragma once

#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#define LOMO_HD __host__ __device__
#define LOMO_INLINE __forceinline__
#elif defined(_MSC_VER)
#define LOMO_HD
#define LOMO_INLINE __forceinline
#else
#define LOMO_HD
#define LOMO_INLINE inline __attribute__((always_inline))
#endif

#if defined(__clang__) && !defined(__CUDA_ARCH__)
// Clang honours the standard pragma; GCC needs -ffp-contract=off on the command line.
#pragma STDC FP_CONTRACT OFF
#endif

namespace lomo {

// Dtype codes shared by the CUDA launchers and their binding.
enum DtypeCode : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// ---------------------------------------------------------------------------------------
// Bit casts and correctly rounded fp32 arithmetic
// ---------------------------------------------------------------------------------------

// Device code uses the intrinsics; host code the portable forms (a memcpy bit cast, and plain
// operators, rounded once each because host builds use -ffp-contract=off: the reference has
// no fused multiply-add).
#if defined(__CUDA_ARCH__)
LOMO_HD LOMO_INLINE uint32_t bits_of(float v) { return __float_as_uint(v); }
LOMO_HD LOMO_INLINE float float_of(uint32_t u) { return __uint_as_float(u); }
LOMO_HD LOMO_INLINE float mul_rn(float a, float b) { return __fmul_rn(a, b); }
LOMO_HD LOMO_INLINE float sub_rn(float a, float b) { return __fsub_rn(a, b); }
LOMO_HD LOMO_INLINE float add_rn(float a, float b) { return __fadd_rn(a, b); }
#else
template <class To, class From>
LOMO_HD LOMO_INLINE To bit_cast(From v) {
  static_assert(sizeof(To) == sizeof(From), "a bit cast keeps the size");
  To out;
  memcpy(&out, &v, sizeof(out));
  return out;
}
LOMO_HD LOMO_INLINE uint32_t bits_of(float v) { return bit_cast<uint32_t>(v); }
LOMO_HD LOMO_INLINE float float_of(uint32_t u) { return bit_cast<float>(u); }
LOMO_HD LOMO_INLINE float mul_rn(float a, float b) { return a * b; }
LOMO_HD LOMO_INLINE float sub_rn(float a, float b) { return a - b; }
LOMO_HD LOMO_INLINE float add_rn(float a, float b) { return a + b; }
#endif

// A float compare (one vector instruction); correct as long as -ffast-math is not used.
LOMO_HD LOMO_INLINE bool is_nan(float v) { return v != v; }

// 1 when v is inf or nan (a bit test: stays correct under any floating-point flags).
LOMO_HD LOMO_INLINE uint32_t is_nonfinite(float v) {
  return (bits_of(v) & 0x7F800000u) == 0x7F800000u ? 1u : 0u;
}

// ---------------------------------------------------------------------------------------
// Hash for stochastic rounding (_rounding.mix32 / random_bits16)
// ---------------------------------------------------------------------------------------

LOMO_HD LOMO_INLINE uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// 16 random bits of flat element index (hi << 32 | lo) under the per-call key.
LOMO_HD LOMO_INLINE uint32_t random_bits16(uint32_t lo, uint32_t hi, uint32_t key) {
  return mix32(mix32(lo ^ key) ^ hi) >> 16;
}

// The accumulation's stream (_rounding.pair_bits16): one hash per pair of elements i and
// i ^ 16. With u = lo ^ key, the pair's hash input is pair_input(u, hi) (u without its bit 4);
// the element with bit 4 of u clear takes the hash's low half, the other its high half. For a
// block of 32 from a multiple of 32, `first`, the inputs are pair_input(first ^ key, hi) ^ l
// (l = 0 .. 15), elements first + l take the low halves unless bit 4 of key is set, and
// elements first + 16 + l the other halves.
constexpr uint32_t kPairHiMul = 0x2545F491u;  // _rounding._PAIR_HI_MUL

LOMO_HD LOMO_INLINE uint32_t pair_input(uint32_t u, uint32_t hi) {
  return (((u >> 5) << 4) | (u & 15u)) ^ (hi * kPairHiMul);
}

// mix32 after its first step (x ^= x >> 16), up to its last multiply: the hash is y ^ (y >> 16)
// of this y, so its high half is y's and its low half (y ^ (y >> 16)) & 0xFFFF.
LOMO_HD LOMO_INLINE uint32_t mix32_product(uint32_t x) {
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  return x * 0x846CA68Bu;
}

// mix32's first step on the pair inputs of the block of 32 from `first`, a multiple of 32:
// they are pair_input(first ^ key, hi) ^ l (l < 16), which differ below bit 16 only, so theirs
// is this value ^ l.
LOMO_HD LOMO_INLINE uint32_t pair_block_input(uint32_t first, uint32_t hi, uint32_t key) {
  const uint32_t input = pair_input(first ^ key, hi);
  return input ^ (input >> 16);
}

LOMO_HD LOMO_INLINE uint32_t pair_bits16(uint32_t lo, uint32_t hi, uint32_t key) {
  const uint32_t u = lo ^ key;
  const uint32_t h = mix32(pair_input(u, hi));
  return (u & 16u) != 0 ? h >> 16 : h & 0xFFFFu;
}

// _rounding.seed_parts(seed): the host's share of a 64-bit seed's rounding key.
LOMO_HD LOMO_INLINE uint32_t seed_lo_mixed(uint64_t seed) {
  return mix32(static_cast<uint32_t>(seed));
}

LOMO_HD LOMO_INLINE uint32_t seed_hi_salted(uint64_t seed) {
  return static_cast<uint32_t>(seed >> 32) ^ 0x9E3779B9u;  // _rounding._SEED_SALT
}

// The per-call key from the host's _rounding.seed_parts(seed) and the per-step value (0 when
// absent; read from device memory by the caller): _rounding.seed_key(seed, step).
LOMO_HD LOMO_INLINE uint32_t rounding_key(uint32_t seed_lo_mixed, uint32_t seed_hi_salted,
                                          uint32_t step) {
  return seed_lo_mixed ^ mix32(seed_hi_salted ^ step);
}

// ---------------------------------------------------------------------------------------
// bf16 (as uint16 bit patterns)
// ---------------------------------------------------------------------------------------

LOMO_HD LOMO_INLINE float bf16_to_f32(uint16_t h) { return float_of((uint32_t)h << 16); }

// Round to nearest even on the bit pattern; nan becomes a quiet nan, inf stays inf.
LOMO_HD LOMO_INLINE uint16_t f32_to_bf16_rne(float v) {
  const uint32_t b = bits_of(v);
  const uint32_t rounded = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (b >> 16) | 0x0040u;
  return (uint16_t)(is_nan(v) ? quiet_nan : rounded);
}

// Stochastic rounding: add 16 uniform bits below the kept ones, then truncate.
LOMO_HD LOMO_INLINE uint16_t f32_to_bf16_sr(float v, uint32_t random16) {
  const uint32_t b = bits_of(v);
  const uint32_t mag = b & 0x7FFFFFFFu;
  const uint32_t add = mag >= 0x7F800000u ? 0u : random16;  // inf/nan are not perturbed
  const uint32_t out = (b + add) >> 16;
  return (uint16_t)(is_nan(v) ? (out | 0x0040u) : out);
}

// ---------------------------------------------------------------------------------------
// fp16 (as uint16 bit patterns)
// ---------------------------------------------------------------------------------------

// Exact fp16 -> fp32 with integer operations and selects only, so compilers vectorise it
// (GCC 12 leaves _Float16 conversions scalar).
LOMO_HD LOMO_INLINE float fp16_to_f32_portable(uint16_t h) {
  const uint32_t sign = ((uint32_t)h & 0x8000u) << 16;
  const uint32_t mag = (uint32_t)h & 0x7FFFu;
  // Subnormal or zero: mag * 2^-24 is exact in fp32.
  const float small = (float)(int32_t)mag * 5.9604644775390625e-8f;
  // Normal: move exponent/mantissa into place and rebias 15 -> 127; inf/nan need 255.
  uint32_t big = (mag << 13) + (112u << 23);
  big = mag >= 0x7C00u ? big + (112u << 23) : big;
  const uint32_t out = mag < 0x0400u ? bits_of(small) : big;
  return float_of(out | sign);
}

// Exact fp32 -> fp16, round to nearest even, overflow to inf, subnormals kept.
LOMO_HD LOMO_INLINE uint16_t f32_to_fp16_portable(float v) {
  const uint32_t b = bits_of(v);
  const uint32_t sign = (b >> 16) & 0x8000u;
  const uint32_t mag = b & 0x7FFFFFFFu;
  // Normal range: rebias 127 -> 15 and round away the low 13 mantissa bits (a carry
  // correctly bumps the exponent).
  const uint32_t rebiased = mag - (112u << 23);
  const uint32_t normal = (rebiased + 0x0FFFu + ((rebiased >> 13) & 1u)) >> 13;
  // Below 2^-14: adding 0.5 leaves the fp16 subnormal count, rounded to nearest even by
  // the fp32 addition itself, in the low mantissa bits.
  const uint32_t subnormal = bits_of(float_of(mag) + 0.5f) - 0x3F000000u;
  uint32_t out = mag < 0x38800000u ? subnormal : normal;
  out = mag >= 0x477FF000u ? 0x7C00u : out;                     // rounds to inf
  out = mag > 0x7F800000u ? (0x7E00u | ((mag >> 13) & 0x03FFu)) : out;  // quiet nan
  return (uint16_t)(out | sign);
}

// The hardware conversions on the device (the same exact IEEE results), the portable ones on
// the host.
#if defined(__CUDA_ARCH__)
LOMO_HD LOMO_INLINE float fp16_to_f32(uint16_t h) { return __half2float(__ushort_as_half(h)); }
LOMO_HD LOMO_INLINE uint16_t f32_to_fp16(float v) { return __half_as_ushort(__float2half_rn(v)); }
#else
LOMO_HD LOMO_INLINE float fp16_to_f32(uint16_t h) { return fp16_to_f32_portable(h); }
LOMO_HD LOMO_INLINE uint16_t f32_to_fp16(float v) { return f32_to_fp16_portable(v); }
#endif

// fp32 bit patterns (magnitudes) of fp16's smallest normal (2^-14) and largest finite (65504).
constexpr uint32_t kFp16MinNormalBits = 0x38800000u;
constexpr uint32_t kFp16MaxBits = 0x477FE000u;

// The fp16 subnormal count |x| * 2^24 of a magnitude below 2^-14 (mag < kFp16MinNormalBits)
// rounded stochastically, as _rounding.fp16_stochastic: from q17 = floor(|x| * 2^41), the
// count with 17 fraction bits (whole * 2^17 + frac17), up iff frac17 + 2 random16 + 1 >=
// 2^17 (the random value centred in its 2^-16 cell), a tie (a sum of exactly 2^17 from an
// exact q17) rounded down for odd random16. |x| = m * 2^(e - 150) with the implicit bit, so
// q17 = m * 2^(e - 109): a left shift by 1 to 3 for e = 110 .. 112 (exact), or a right one
// by 109 - e, exact when it drops no set bit (from 24 on everything goes, fp32 subnormals
// included: q17 = 0, where no tie can arise).
LOMO_HD LOMO_INLINE uint32_t fp16_subnormal_count_sr(uint32_t mag, uint32_t random16) {
  uint32_t e = mag >> 23;
  e = e > 112u ? 112u : e;  // defined shifts for magnitudes the caller does not select
  const uint32_t m = (mag & 0x007FFFFFu) | 0x00800000u;
  const uint32_t right = 109u - (e > 109u ? 109u : e);  // 0 for a left shift
  const uint32_t q17 = e > 109u ? m << (e - 109u) : (right < 24u ? m >> right : 0u);
  const uint32_t exact = right < 24u && (m & ((1u << right) - 1u)) == 0u;
  return (q17 + 2u * random16 + 1u - (random16 & exact)) >> 17;
}

// Stochastic rounding onto the fp16 grid, _rounding.fp16_stochastic bit for bit, with
// `random16` uniform 16-bit integers: the result as an fp32 value (exactly representable in
// fp16, so any exact fp32 -> fp16 conversion stores it; beyond 65504, inf and nan it is v
// itself, which the nearest conversion then rounds as the reference's cast does).
//   normal (2^-14 <= |v| <= 65504): random16 >> 3 added below fp16's 10 mantissa bits, the
//     low 13 bits cleared (a carry correctly bumps the exponent, up to 65504 at most);
//   subnormal: fp16_subnormal_count_sr units of 2^-24.
LOMO_HD LOMO_INLINE float fp16_sr_value(float v, uint32_t random16) {
  const uint32_t b = bits_of(v);
  const uint32_t mag = b & 0x7FFFFFFFu;
  const uint32_t normal = (mag + (random16 >> 3)) & ~0x1FFFu;
  const uint32_t count = fp16_subnormal_count_sr(mag, random16);  // <= 1024: exact
  const uint32_t small = bits_of(static_cast<float>(static_cast<int32_t>(count)) *
                                 5.9604644775390625e-8f);  // * 2^-24, exact
  const uint32_t rounded = (mag < kFp16MinNormalBits ? small : normal) | (b & 0x80000000u);
  return mag > kFp16MaxBits ? v : float_of(rounded);
}

// The same as fp16 bits (f32_to_fp16 of fp16_sr_value), straight from the integers: the
// subnormal count is the fp16 pattern itself (1024 is 2^-14, the smallest normal), a normal
// result is rebiased 127 -> 15; beyond 65504, inf and nan the nearest conversion.
LOMO_HD LOMO_INLINE uint16_t f32_to_fp16_sr(float v, uint32_t random16) {
  const uint32_t b = bits_of(v);
  const uint32_t mag = b & 0x7FFFFFFFu;
  const uint32_t normal = (mag + (random16 >> 3) - (112u << 23)) >> 13;  // wraps if unused
  const uint32_t subnormal = fp16_subnormal_count_sr(mag, random16);
  const uint32_t out = (mag < kFp16MinNormalBits ? subnormal : normal) | ((b >> 16) & 0x8000u);
  return mag > kFp16MaxBits ? f32_to_fp16(v) : static_cast<uint16_t>(out);
}

// Storage traits: T is the stored type, load() widens to fp32, round() narrows (nearest
// even), round_sr() narrows stochastically with 16 random bits (bf16 and fp16; fp32 stores
// the value itself).
struct Fp32 {
  using T = float;
  static constexpr int code = kFloat32;
  static constexpr bool kRoundsStochastically = false;
  LOMO_HD LOMO_INLINE static float load(T v) { return v; }
  LOMO_HD LOMO_INLINE static T round(float v) { return v; }
  LOMO_HD LOMO_INLINE static T round_sr(float v, uint32_t) { return v; }
};

struct Fp16 {
  using T = uint16_t;
  static constexpr int code = kFloat16;
  static constexpr bool kRoundsStochastically = true;
  LOMO_HD LOMO_INLINE static float load(T v) { return fp16_to_f32(v); }
  LOMO_HD LOMO_INLINE static T round(float v) { return f32_to_fp16(v); }
  LOMO_HD LOMO_INLINE static T round_sr(float v, uint32_t random16) {
    return f32_to_fp16_sr(v, random16);
  }
};

struct Bf16 {
  using T = uint16_t;
  static constexpr int code = kBFloat16;
  static constexpr bool kRoundsStochastically = true;
  LOMO_HD LOMO_INLINE static float load(T v) { return bf16_to_f32(v); }
  LOMO_HD LOMO_INLINE static T round(float v) { return f32_to_bf16_rne(v); }
  LOMO_HD LOMO_INLINE static T round_sr(float v, uint32_t random16) {
    return f32_to_bf16_sr(v, random16);
  }
};

// P::round_sr with the bits of flat element index (hi << 32 | lo), or P::round: the
// write-back of every kernel.
template <class P, bool kStochastic>
LOMO_HD LOMO_INLINE typename P::T store_rounded(float v, uint32_t lo, uint32_t hi, uint32_t key) {
  if constexpr (kStochastic) {
    return P::round_sr(v, random_bits16(lo, hi, key));
  } else {
    return P::round(v);
  }
}

// The same, of the element at 64-bit flat index `index`.
template <class P, bool kStochastic>
LOMO_HD LOMO_INLINE typename P::T store_rounded(float v, int64_t index, uint32_t key) {
  return store_rounded<P, kStochastic>(v, static_cast<uint32_t>(index),
                                       static_cast<uint32_t>(index >> 32), key);
}

// P::round_sr with the accumulation's bits of flat element index `index` (pair_bits16), or
// P::round: what grad_accumulate_ stores.
template <class P, bool kStochastic>
LOMO_HD LOMO_INLINE typename P::T store_accumulated(float v, int64_t index, uint32_t key) {
  if constexpr (kStochastic) {
    return P::round_sr(v, pair_bits16(static_cast<uint32_t>(index),
                                      static_cast<uint32_t>(index >> 32), key));
  } else {
    return P::round(v);
  }
}

// ---------------------------------------------------------------------------------------
// The update of one element
// ---------------------------------------------------------------------------------------

// The gradient's scalars, each already read as fp32 (1 for an absent factor).
struct GradScalars {
  float inv_scale;  // grad multiplier (1 / loss scale)
  float clip;       // clamp bound; +inf when clipping by value is off
  float coef;       // clip-by-norm coefficient; 1 when off
};

// Scalars exactly as the reference computes them (each already rounded to fp32).
struct LomoScalars {
  float inv_scale;  // grad multiplier; 1 when absent (x * 1 == x)
  float clip;       // clamp bound; +inf when clipping by value is off
  float coef;       // clip-by-norm coefficient; 1 when absent
  float lr;
  float decay;      // fp32(1 - fp32(lr * weight_decay))
};

// Exponent field of an inf/nan fp32 value.
constexpr uint32_t kNonFiniteExponent = 0x7F800000u;

// Returns the new fp32 parameter value and the exponent field of the unscaled gradient:
// kNonFiniteExponent means inf/nan, and the caller keeps the old parameter bits. (Callers
// can OR-reduce the flag or max-reduce the exponent, whichever vectorises better.)
LOMO_HD LOMO_INLINE float lomo_element_exp(float grad, float param, const LomoScalars& s,
                                          uint32_t& exponent) {
  float g = mul_rn(grad, s.inv_scale);
  exponent = bits_of(g) & kNonFiniteExponent;
  // torch.clamp(g, -clip, clip) as selects; a nan g is never written, so its path is moot.
  g = g < -s.clip ? -s.clip : g;
  g = g > s.clip ? s.clip : g;
  g = mul_rn(g, s.coef);
  return sub_rn(mul_rn(param, s.decay), mul_rn(s.lr, g));
}

// As lomo_element_exp, with bad = 1 when the unscaled gradient is inf/nan.
LOMO_HD LOMO_INLINE float lomo_element(float grad, float param, const LomoScalars& s,
                                      uint32_t& bad) {
  uint32_t exponent;
  const float updated = lomo_element_exp(grad, param, s, exponent);
  bad = exponent == kNonFiniteExponent ? 1u : 0u;
  return updated;
}

}  // namespace lomo
