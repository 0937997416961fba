// The CPU loops of the fused LOMO update, the gradient sum of squares and the gradient
// accumulation (into a dense buffer here, into an 8-bit one in lomo_cpu_int8.h, included at
// the end), at one vector level. lomo_cpu.cpp includes this file once per level through
// cpu_levels.h (each copy in its own namespace and GCC target, with LOMO_LOOPS_AVX2,
// LOMO_LOOPS_AVX512 and LOMO_LOOPS_AVX512_BF16 set to 0 or 1), so no include guard; everything
// it needs is included before (torch, <immintrin.h>, lomo_math.h, int8_blocks.h). Every level
// gives bit-identical results.
//
// The hot loops are plain loops over raw pointers with selects instead of branches, so the
// compiler vectorises them for the level (built with -O3 -fno-trapping-math
// -ffp-contract=off; the first lets selects between float values be if-converted, the second
// keeps the reference's rounding); the common same-dtype pairs have hand-written vector loops.

// Software prefetch a fixed distance ahead of the streams, one line per 64 bytes: the
// hardware prefetchers alone leave the 2-thread loops well short of bandwidth (measured
// at 32M elements: fp32 full option set 0.96 -> 0.84 of torch._fused_sgd_, bf16 7.1 ->
// 4.0 ms). Prefetches never fault, so running past the end of an array is harmless.
constexpr int64_t kPrefetchBytes = 4096;
constexpr int64_t kLineBytes = 64;

// What an accumulation pass measures of the values it stores (dtype_dispatch.h).
using lomo::Measure;

// kWrite: the line will be written (PREFETCHW where the target has it: no ownership
// request later).
template <bool kWrite>
LOMO_INLINE void prefetch_line(const char* address) {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(address, kWrite ? 1 : 0, 3);
#else
  (void)address;
#endif
}

LOMO_INLINE void prefetch_ahead(const void* p, const void* g) {
  prefetch_line<true>(static_cast<const char*>(p) + kPrefetchBytes);
  prefetch_line<false>(static_cast<const char*>(g) + kPrefetchBytes);
}

// The lines of [ptr, ptr + bytes), kPrefetchBytes ahead.
template <bool kWrite>
LOMO_INLINE void prefetch_lines_ahead(const void* ptr, int64_t bytes) {
  const char* ahead = static_cast<const char*>(ptr) + kPrefetchBytes;
  for (int64_t k = 0; k < bytes; k += kLineBytes) prefetch_line<kWrite>(ahead + k);
}

// The update of n consecutive elements, one at a time. lo/hi: 32-bit halves of the flat
// index of element 0 (the block never crosses a multiple of 2^32, so lo + i cannot wrap).
template <class P, class G, bool kStochastic>
uint32_t update_elements(typename P::T* __restrict p, const typename G::T* __restrict g,
                         int64_t n, uint32_t lo, uint32_t hi, const lomo::LomoScalars s,
                         uint32_t key) {
  // Max of the gradient exponents: one vpmaxud per vector, fewer instructions than an OR
  // of 0/1 flags in this loop (the fp32 path).
  uint32_t max_exponent = 0;
  for (int64_t i = 0; i < n; ++i) {
    const typename P::T old = p[i];
    uint32_t exponent;
    const float updated = lomo::lomo_element_exp(G::load(g[i]), P::load(old), s, exponent);
    const typename P::T out = lomo::store_rounded<P, kStochastic>(
        updated, lo + static_cast<uint32_t>(i), hi, key);
    p[i] = exponent == lomo::kNonFiniteExponent ? old : out;
    max_exponent = std::max(max_exponent, exponent);
  }
  return max_exponent == lomo::kNonFiniteExponent ? 1u : 0u;
}

// bf16 params: two elements per 32-bit word. The even element is word << 16, the odd one
// word & 0xFFFF0000, and the result is reassembled the same way, so the vector loop needs
// no 16 <-> 32-bit lane packing (measured ~15-20% faster than update_elements in cache).
template <class G>
LOMO_INLINE void load_pair(const typename G::T* g, int64_t k, float& even, float& odd) {
  if constexpr (std::is_same_v<G, lomo::Bf16>) {
    uint32_t w;
    memcpy(&w, g + 2 * k, sizeof(w));
    even = lomo::float_of(w << 16);
    odd = lomo::float_of(w & 0xFFFF0000u);
  } else {
    even = G::load(g[2 * k]);
    odd = G::load(g[2 * k + 1]);
  }
}

// Rounded bf16 bits of v in the high half of a word, low half zero (f32_to_bf16_rne << 16).
LOMO_INLINE uint32_t bf16_rne_high(float v) {
  const uint32_t b = lomo::bits_of(v);
  const uint32_t rounded = (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;
  const uint32_t quiet_nan = (b | 0x00400000u) & 0xFFFF0000u;
  return lomo::is_nan(v) ? quiet_nan : rounded;
}

template <class G, bool kStochastic>
uint32_t update_bf16_pairs(uint16_t* __restrict p, const typename G::T* __restrict g, int64_t n,
                           uint32_t lo, uint32_t hi, const lomo::LomoScalars s, uint32_t key) {
  uint32_t any_bad = 0;
  const int64_t pairs = n / 2;
  for (int64_t k = 0; k < pairs; ++k) {
    uint32_t word;
    memcpy(&word, p + 2 * k, sizeof(word));
    float g_even, g_odd;
    load_pair<G>(g, k, g_even, g_odd);
    uint32_t bad_even, bad_odd;
    const float u_even =
        lomo::lomo_element(g_even, lomo::float_of(word << 16), s, bad_even);
    const float u_odd =
        lomo::lomo_element(g_odd, lomo::float_of(word & 0xFFFF0000u), s, bad_odd);
    uint32_t out_even, out_odd;
    if constexpr (kStochastic) {
      const uint32_t index = lo + static_cast<uint32_t>(2 * k);
      out_even = lomo::f32_to_bf16_sr(u_even, lomo::random_bits16(index, hi, key));
      out_odd = static_cast<uint32_t>(
                    lomo::f32_to_bf16_sr(u_odd, lomo::random_bits16(index + 1u, hi, key)))
                << 16;
    } else {
      out_even = bf16_rne_high(u_even) >> 16;
      out_odd = bf16_rne_high(u_odd);
    }
    out_even = bad_even ? (word & 0xFFFFu) : out_even;
    out_odd = bad_odd ? (word & 0xFFFF0000u) : out_odd;
    const uint32_t out = out_even | out_odd;
    memcpy(p + 2 * k, &out, sizeof(out));
    any_bad |= bad_even | bad_odd;
  }
  if (n & 1) {
    any_bad |= update_elements<lomo::Bf16, G, kStochastic>(
        p + n - 1, g + n - 1, 1, lo + static_cast<uint32_t>(n - 1), hi, s, key);
  }
  return any_bad;
}

#if LOMO_LOOPS_AVX2
#include "lomo_cpu_lanes.h"
#endif

#if LOMO_LOOPS_AVX512
// AVX-512 loops for the common same-dtype pairs (fp32, bf16 with nearest rounding): GCC
// prefers 256-bit vectors and spends extra instructions on the generic loops, which are
// compute-bound at two threads. Options that are neutral at run time are compiled out
// (x * 1 == x, clamping to +-inf and decay 1 change nothing): 16 instantiations per loop.
enum SgdFlags : int { kUnscale = 1, kClip = 2, kDecay = 4, kCoef = 8, kFlagCount = 16 };

struct SgdVectors {
  lomo::LomoScalars scalars;
  __m512 inv_scale, neg_clip, clip, coef, lr, decay;
  explicit SgdVectors(const lomo::LomoScalars& s)
      : scalars(s),
        inv_scale(_mm512_set1_ps(s.inv_scale)),
        neg_clip(_mm512_set1_ps(-s.clip)),
        clip(_mm512_set1_ps(s.clip)),
        coef(_mm512_set1_ps(s.coef)),
        lr(_mm512_set1_ps(s.lr)),
        decay(_mm512_set1_ps(s.decay)) {}
};

int sgd_flags(const lomo::LomoScalars& s) {
  return (s.inv_scale != 1.0f ? kUnscale : 0) |
         (s.clip != std::numeric_limits<float>::infinity() ? kClip : 0) |
         (s.decay != 1.0f ? kDecay : 0) | (s.coef != 1.0f ? kCoef : 0);
}

// The vector loops clamp with one VRANGEPS, which needs a bound >= 0 (the public op
// refuses others); any other bound takes the generic loops, which follow torch.clamp.
bool avx512_supports(const lomo::LomoScalars& s) { return s.clip >= 0.0f; }

// Lanes whose value is inf or nan.
LOMO_INLINE __mmask16 nonfinite_mask(__m512 v) {
  return _mm512_fpclass_ps_mask(v, 0x99);  // qnan | +inf | -inf | snan
}

// torch.clamp(g, -clip, clip) for clip >= 0. VRANGEPS "smaller magnitude, sign of g" is
// the clamp in one instruction: ties pick equal magnitudes, -0 stays -0 (nan lanes are
// never written). MAX/MIN take the bound first: they return the second operand on ties
// and nans, exactly like the reference's selects.
LOMO_INLINE __m512 clamp_vector(__m512 g, const SgdVectors& v) {
  return _mm512_range_ps(g, v.clip, 0x02);
}

// lomo_element on 16 lanes; bad = lanes whose unscaled gradient is inf/nan (when kCheck).
template <int kF, bool kCheck = true>
LOMO_INLINE __m512 sgd_vector(__m512 g, __m512 p, const SgdVectors& v, __mmask16& bad) {
  if constexpr ((kF & kUnscale) != 0) g = _mm512_mul_ps(g, v.inv_scale);
  if constexpr (kCheck) bad = nonfinite_mask(g);
  if constexpr ((kF & kClip) != 0) g = clamp_vector(g, v);
  if constexpr ((kF & kCoef) != 0) g = _mm512_mul_ps(g, v.coef);
  if constexpr ((kF & kDecay) != 0) p = _mm512_mul_ps(p, v.decay);
  return _mm512_sub_ps(p, _mm512_mul_ps(v.lr, g));
}

// The updated fp32 values of 32 bf16 elements: lo holds elements 8L + k of each 128-bit
// lane L, hi elements 8L + 4 + k; bad_lo/bad_hi flag their inf/nan gradients.
struct Bf16Block {
  __m512 lo, hi;
  __mmask16 bad_lo, bad_hi;
};

// sgd_vector of the 32 bf16 elements at p and g, unpacked against zero (which widens each
// 128-bit lane to fp32 exactly).
template <int kF>
LOMO_INLINE Bf16Block sgd_bf16_block(const uint16_t* p, const uint16_t* g, const SgdVectors& v) {
  const __m512i zero = _mm512_setzero_si512();
  const __m512i pw = _mm512_loadu_si512(p);
  const __m512i gw = _mm512_loadu_si512(g);
  Bf16Block u;
  u.lo = sgd_vector<kF>(_mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, gw)),
                        _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, pw)), v, u.bad_lo);
  u.hi = sgd_vector<kF>(_mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, gw)),
                        _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, pw)), v, u.bad_hi);
  return u;
}

template <int kF>
uint32_t update_fp32_avx512(float* __restrict p, const float* __restrict g, int64_t n,
                            const lomo::LomoScalars& s) {
  const SgdVectors v(s);
  __mmask16 any_bad = 0;
  int64_t i = 0;
  // Two vectors per trip halve the loop overhead, which shows at two threads.
#pragma GCC unroll 2
  for (; i + 16 <= n; i += 16) {
    prefetch_ahead(p + i, g + i);
    const __m512 old = _mm512_loadu_ps(p + i);
    __mmask16 bad;
    const __m512 u = sgd_vector<kF>(_mm512_loadu_ps(g + i), old, v, bad);
    _mm512_storeu_ps(p + i, _mm512_mask_mov_ps(u, bad, old));
    any_bad |= bad;
  }
  return (any_bad != 0 ? 1u : 0u) |
         update_elements<lomo::Fp32, lomo::Fp32, false>(p + i, g + i, n - i, 0, 0, s, 0);
}

// bf16_rne_high on 16 lanes; lanes in bad keep old (a bf16 value in the high half).
LOMO_INLINE __m512i bf16_rne_high_vector(__m512 u, __m512i old, __mmask16 bad) {
  const __m512i b = _mm512_castps_si512(u);
  // b + 0x7FFF, or b + 0x8000 where the lowest kept bit is set (ties to even).
  const __mmask16 odd = _mm512_test_epi32_mask(b, _mm512_set1_epi32(0x10000));
  __m512i r = _mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF));
  r = _mm512_mask_add_epi32(r, odd, b, _mm512_set1_epi32(0x8000));
  const __mmask16 nan = _mm512_cmp_ps_mask(u, u, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, b, _mm512_set1_epi32(0x00400000));
  return _mm512_mask_mov_epi32(r, bad, old);
}

#if LOMO_LOOPS_AVX512_BF16
// 32 bf16 elements per step (sgd_bf16_block). VCVTNE2PS2BF16 rounds to nearest even and
// quiets nans as the reference does, and vpermw restores element order. The instruction
// treats subnormal inputs as zero, so a block with a subnormal result takes the exact loop,
// as does a block with an inf/nan gradient (rare: the step is then skipped anyway); the
// vector loop itself never blends.
template <int kF>
uint32_t update_bf16_avx512(uint16_t* __restrict p, const uint16_t* __restrict g, int64_t n,
                            const lomo::LomoScalars& s) {
  const SgdVectors v(s);
  const __m512i order = _mm512_set_epi16(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10,
                                         9, 8, 23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2,
                                         1, 0);
  uint32_t any_bad = 0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    prefetch_ahead(p + i, g + i);
    const Bf16Block u = sgd_bf16_block<kF>(p + i, g + i, v);
    const __mmask16 exact = u.bad_lo | u.bad_hi | _mm512_fpclass_ps_mask(u.lo, 0x20) |
                            _mm512_fpclass_ps_mask(u.hi, 0x20);
    if (__builtin_expect(exact != 0, 0)) {
      any_bad |= update_bf16_pairs<lomo::Bf16, false>(p + i, g + i, 32, 0, 0, s, 0);
      continue;
    }
    const __m512i packed = (__m512i)_mm512_cvtne2ps_pbh(u.hi, u.lo);  // same bits
    _mm512_storeu_si512(p + i, _mm512_permutexvar_epi16(order, packed));
  }
  return any_bad | update_bf16_pairs<lomo::Bf16, false>(p + i, g + i, n - i, 0, 0, s, 0);
}
#else
// 32 bf16 elements per step, split into even/odd halves of each 32-bit word as in
// update_bf16_pairs, rounded with integer operations (no AVX512-BF16 here).
template <int kF>
uint32_t update_bf16_avx512(uint16_t* __restrict p, const uint16_t* __restrict g, int64_t n,
                            const lomo::LomoScalars& s) {
  const SgdVectors v(s);
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __mmask16 any_bad = 0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512i pw = _mm512_loadu_si512(p + i);
    const __m512i gw = _mm512_loadu_si512(g + i);
    const __m512i p_even = _mm512_slli_epi32(pw, 16);
    const __m512i p_odd = _mm512_and_si512(pw, high);
    __mmask16 bad_even, bad_odd;
    const __m512 u_even = sgd_vector<kF>(_mm512_castsi512_ps(_mm512_slli_epi32(gw, 16)),
                                         _mm512_castsi512_ps(p_even), v, bad_even);
    const __m512 u_odd = sgd_vector<kF>(_mm512_castsi512_ps(_mm512_and_si512(gw, high)),
                                        _mm512_castsi512_ps(p_odd), v, bad_odd);
    const __m512i r_even = bf16_rne_high_vector(u_even, p_even, bad_even);
    const __m512i r_odd = bf16_rne_high_vector(u_odd, p_odd, bad_odd);
    // (r_odd & high) | (r_even >> 16)
    const __m512i out = _mm512_ternarylogic_epi32(r_odd, _mm512_srli_epi32(r_even, 16), high, 0xE4);
    _mm512_storeu_si512(p + i, out);
    any_bad |= bad_even | bad_odd;
  }
  return (any_bad != 0 ? 1u : 0u) |
         update_bf16_pairs<lomo::Bf16, false>(p + i, g + i, n - i, 0, 0, s, 0);
}
#endif

// lomo::f32_to_bf16_sr on 16 lanes, the result in the high half of each lane. index: the
// low 32 bits of each lane's flat element index (random_bits16's hash of it).
LOMO_INLINE __m512i bf16_sr_high_vector(__m512 u, __m512i index, __m512i key, __m512i hi) {
  const __m512i random = _mm512_srli_epi32(random_product<Lanes16>(index, key, hi), 16);
  const __m512i b = _mm512_castps_si512(u);
  const __mmask16 nonfinite = nonfinite_mask(u);  // inf/nan are not perturbed
  const __m512i out = _mm512_mask_add_epi32(b, static_cast<__mmask16>(~nonfinite), b, random);
  const __mmask16 nan = _mm512_cmp_ps_mask(u, u, _CMP_UNORD_Q);
  return _mm512_mask_or_epi32(out, nan, out, _mm512_set1_epi32(0x00400000));
}

// bf16 params with stochastic rounding, 32 elements per step: the layout of the nearest
// rounding loop (unpack against zero), the hash on 16 lanes, and one vpermt2w that takes
// the high halves back in element order. Integer rounding is exact for subnormal results,
// so only a block with an inf/nan gradient takes the exact loop.
template <int kF>
uint32_t update_bf16_sr_avx512(uint16_t* __restrict p, const uint16_t* __restrict g, int64_t n,
                               uint32_t lo, uint32_t hi, uint32_t key,
                               const lomo::LomoScalars& s) {
  const SgdVectors v(s);
  // Element offset of each lane: lane k of 128-bit lane L holds element 8L + k (unpacklo)
  // or 8L + 4 + k (unpackhi).
  const __m512i offset_lo =
      _mm512_set_epi32(27, 26, 25, 24, 19, 18, 17, 16, 11, 10, 9, 8, 3, 2, 1, 0);
  const __m512i offset_hi = _mm512_add_epi32(offset_lo, _mm512_set1_epi32(4));
  // Output element e = 8L + k: the high word of dword 4L + k of the first operand (k < 4)
  // or of dword 4L + k - 4 of the second (word index + 32).
  const __m512i gather_high = _mm512_set_epi16(63, 61, 59, 57, 31, 29, 27, 25, 55, 53, 51, 49,
                                               23, 21, 19, 17, 47, 45, 43, 41, 15, 13, 11, 9,
                                               39, 37, 35, 33, 7, 5, 3, 1);
  const __m512i key_v = _mm512_set1_epi32(static_cast<int>(key));
  const __m512i hi_v = _mm512_set1_epi32(static_cast<int>(hi));
  uint32_t any_bad = 0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    prefetch_ahead(p + i, g + i);
    const Bf16Block u = sgd_bf16_block<kF>(p + i, g + i, v);
    const uint32_t first = lo + static_cast<uint32_t>(i);  // no wrap: see update_span
    if (__builtin_expect((u.bad_lo | u.bad_hi) != 0, 0)) {
      any_bad |= update_bf16_pairs<lomo::Bf16, true>(p + i, g + i, 32, first, hi, s, key);
      continue;
    }
    const __m512i base = _mm512_set1_epi32(static_cast<int>(first));
    const __m512i r_lo = bf16_sr_high_vector(u.lo, _mm512_add_epi32(base, offset_lo), key_v, hi_v);
    const __m512i r_hi = bf16_sr_high_vector(u.hi, _mm512_add_epi32(base, offset_hi), key_v, hi_v);
    _mm512_storeu_si512(p + i, _mm512_permutex2var_epi16(r_lo, gather_high, r_hi));
  }
  return any_bad | update_bf16_pairs<lomo::Bf16, true>(p + i, g + i, n - i,
                                                       lo + static_cast<uint32_t>(i), hi, s, key);
}

// update_fp16_sr on 16 lanes, with the neutral options compiled out as in the loops above.
template <int kF>
uint32_t update_fp16_sr_avx512(uint16_t* __restrict p, const uint16_t* __restrict g, int64_t n,
                               uint32_t lo, uint32_t hi, uint32_t key,
                               const lomo::LomoScalars& s) {
  const SgdVectors v(s);
  return update_fp16_sr<Lanes16>(p, g, n, lo, hi, s, key,
                                 [&](__m512 gv, __m512 pv, __mmask16& bad) {
                                   return sgd_vector<kF>(gv, pv, v, bad);
                                 });
}

// Runs K<flags of s>::run (a loop's instantiation for those flags): a table of the 16,
// indexed at run time.
template <template <int> class K, int... kF, class... A>
uint32_t run_flagged(std::integer_sequence<int, kF...>, const lomo::LomoScalars& s, A... args) {
  using Fn = uint32_t (*)(A..., const lomo::LomoScalars&);
  static constexpr Fn kTable[] = {K<kF>::run...};
  return kTable[sgd_flags(s)](args..., s);
}

template <template <int> class K, class... A>
uint32_t with_flags(const lomo::LomoScalars& s, A... args) {
  return run_flagged<K>(std::make_integer_sequence<int, kFlagCount>{}, s, args...);
}

// The loops above as with_flags takes them.
template <int kF>
struct Fp32Kernel { static constexpr auto run = &update_fp32_avx512<kF>; };
template <int kF>
struct Bf16Kernel { static constexpr auto run = &update_bf16_avx512<kF>; };
template <int kF>
struct Bf16SrKernel { static constexpr auto run = &update_bf16_sr_avx512<kF>; };
template <int kF>
struct Fp16SrKernel { static constexpr auto run = &update_fp16_sr_avx512<kF>; };
#endif

#if LOMO_LOOPS_AVX2
// fp16 operands: the portable integer conversions cost ~25 vector instructions per 16
// elements; F16C converts in one. GCC does not vectorise _Float16 conversions itself, so
// stage tiles through fp32 buffers with the F16C intrinsics (exact IEEE, like the
// portable path) and keep the math loop plain.
constexpr bool kHaveF16C = true;
constexpr int64_t kTile = 256;

void halves_to_floats(const uint16_t* src, float* dst) {
  for (int64_t k = 0; k < kTile; k += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k));
    _mm256_storeu_ps(dst + k, _mm256_cvtph_ps(h));
  }
}

void floats_to_halves(const float* src, uint16_t* dst) {
  for (int64_t k = 0; k < kTile; k += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + k),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + k), h);
  }
}

#include "lomo_cpu_avx2.h"
#include "lomo_cpu_accumulate.h"

template <class P, class G, bool kStochastic>
uint32_t update_tiled(typename P::T* __restrict p, const typename G::T* __restrict g, int64_t n,
                      uint32_t lo, uint32_t hi, const lomo::LomoScalars s, uint32_t key) {
  constexpr bool kHalfP = std::is_same_v<P, lomo::Fp16>;
  constexpr bool kHalfG = std::is_same_v<G, lomo::Fp16>;
  alignas(64) float g_tile[kTile];
  alignas(64) float p_tile[kTile];
  alignas(64) float u_tile[kTile];
  alignas(64) uint32_t bad_tile[kTile];
  alignas(64) uint16_t h_tile[kTile];
  uint32_t any_bad = 0;
  int64_t i = 0;
  for (; i + kTile <= n; i += kTile) {
    typename P::T* __restrict pp = p + i;
    const typename G::T* __restrict gg = g + i;
    prefetch_lines_ahead<true>(pp, kTile * sizeof(typename P::T));
    prefetch_lines_ahead<false>(gg, kTile * sizeof(typename G::T));
    if constexpr (kHalfG) halves_to_floats(gg, g_tile);
    if constexpr (kHalfP) halves_to_floats(pp, p_tile);
    for (int64_t j = 0; j < kTile; ++j) {
      const float gv = kHalfG ? g_tile[j] : G::load(gg[j]);
      const float pv = kHalfP ? p_tile[j] : P::load(pp[j]);
      uint32_t bad;
      u_tile[j] = lomo::lomo_element(gv, pv, s, bad);
      bad_tile[j] = bad;
      any_bad |= bad;
    }
    if constexpr (kHalfP) {
      if constexpr (kStochastic) {
        // Onto the fp16 grid in fp32 (fp16_sr_value): the conversion below is then exact.
        const Avx2Random random(key, hi);
        for (int64_t j = 0; j < kTile; j += 8) {
          const __m256i bits = random.bits(lo + static_cast<uint32_t>(i + j));
          _mm256_store_ps(u_tile + j, fp16_sr_value<Lanes8>(_mm256_load_ps(u_tile + j), bits));
        }
      }
      floats_to_halves(u_tile, h_tile);
      for (int64_t j = 0; j < kTile; ++j) pp[j] = bad_tile[j] ? pp[j] : h_tile[j];
    } else {
      for (int64_t j = 0; j < kTile; ++j) {
        const typename P::T out = lomo::store_rounded<P, kStochastic>(
            u_tile[j], lo + static_cast<uint32_t>(i + j), hi, key);
        pp[j] = bad_tile[j] ? pp[j] : out;
      }
    }
  }
  return any_bad | update_elements<P, G, kStochastic>(p + i, g + i, n - i,
                                                       lo + static_cast<uint32_t>(i), hi, s,
                                                       key);
}

#else
constexpr bool kHaveF16C = false;
#endif

// The paired loop assumes element 2k sits in the low half of a 32-bit word.
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
constexpr bool kLittleEndian = false;
#else
constexpr bool kLittleEndian = true;
#endif

// Picks the loop shape for a dtype pair. Same results whichever is taken.
template <class P, class G, bool kStochastic>
uint32_t update_block(typename P::T* p, const typename G::T* g, int64_t n, uint32_t lo,
                      uint32_t hi, const lomo::LomoScalars& s, uint32_t key) {
  constexpr bool kAnyHalf = std::is_same_v<P, lomo::Fp16> || std::is_same_v<G, lomo::Fp16>;
#if LOMO_LOOPS_AVX512
  constexpr bool kSame = std::is_same_v<P, G> && !kStochastic;
  if constexpr (kSame && std::is_same_v<P, lomo::Fp32>) {
    if (avx512_supports(s)) return with_flags<Fp32Kernel>(s, p, g, n);
  } else if constexpr (kSame && std::is_same_v<P, lomo::Bf16> && kLittleEndian) {
    if (avx512_supports(s)) return with_flags<Bf16Kernel>(s, p, g, n);
  }
  if constexpr (kStochastic && std::is_same_v<P, lomo::Bf16> && std::is_same_v<G, lomo::Bf16> &&
                kLittleEndian) {
    if (avx512_supports(s)) return with_flags<Bf16SrKernel>(s, p, g, n, lo, hi, key);
  }
  if constexpr (kStochastic && std::is_same_v<P, lomo::Fp16> && std::is_same_v<G, lomo::Fp16>) {
    if (avx512_supports(s)) return with_flags<Fp16SrKernel>(s, p, g, n, lo, hi, key);
  }
#endif
#if LOMO_LOOPS_AVX2
  if constexpr (std::is_same_v<P, G> && kLittleEndian) {
    if constexpr (std::is_same_v<P, lomo::Fp32>) {
      return update_fp32_avx2(p, g, n, s);
    } else if constexpr (std::is_same_v<P, lomo::Fp16> && kStochastic) {
      return update_fp16_sr_avx2(p, g, n, lo, hi, s, key);
    } else if constexpr (std::is_same_v<P, lomo::Fp16>) {
      return update_fp16_avx2(p, g, n, s);
    } else {
      return update_bf16_avx2<kStochastic>(p, g, n, lo, hi, s, key);
    }
  }
#endif
  if constexpr (kHaveF16C && kAnyHalf) {
#if LOMO_LOOPS_AVX2
    return update_tiled<P, G, kStochastic>(p, g, n, lo, hi, s, key);
#endif
  } else if constexpr (std::is_same_v<P, lomo::Bf16> && kLittleEndian) {
    return update_bf16_pairs<G, kStochastic>(p, g, n, lo, hi, s, key);
  } else {
    return update_elements<P, G, kStochastic>(p, g, n, lo, hi, s, key);
  }
}

// The elements of [begin, end) in the same 2^32 range of flat indices as `begin`, whose flat
// index is offset + begin: the hash takes the index as two 32-bit halves, and a block that
// keeps the high half fixed runs on 32-bit lanes.
LOMO_INLINE int64_t same_high_half_end(int64_t offset, int64_t begin, int64_t end) {
  // Unsigned: the next multiple of 2^32 after an index near 2^63 is 2^63 itself.
  const uint64_t index = static_cast<uint64_t>(offset + begin);
  const uint64_t room = (((index >> 32) + 1) << 32) - index;  // in [1, 2^32]
  return std::min(end, begin + static_cast<int64_t>(room));
}

// One span [begin, end) of the update of a tensor whose element 0 has flat index `offset`
// in its parameter; returns non-zero if any unscaled grad was inf/nan.
template <class P, class G, bool kStochastic>
uint32_t update_span(typename P::T* param, const typename G::T* grad, int64_t offset,
                     int64_t begin, int64_t end, const lomo::LomoScalars& s, uint32_t key) {
  uint32_t any_bad = 0;
  while (begin < end) {
    const int64_t stop = kStochastic ? same_high_half_end(offset, begin, end) : end;
    const int64_t index = offset + begin;
    any_bad |= update_block<P, G, kStochastic>(
        param + begin, grad + begin, stop - begin, static_cast<uint32_t>(index),
        static_cast<uint32_t>(index >> 32), s, key);
    begin = stop;
  }
  return any_bad;
}

// Sum of squares of grad * inv_scale over one span, in double; sets bad on inf/nan.
// kSumLanes independent partial sums, added in a fixed order at the end: the compiler
// vectorises the lanes at any level (no reassociation needed), and every level, thread
// count and CPU gives the same sum. Each square is exact in double and at most 2^256, so no
// finite sum overflows: the total is non-finite exactly when some scaled element is inf or
// nan, and that one test replaces a check per element.
constexpr int kSumLanes = 8;

// The lanes added in order; bad set when the total is inf/nan.
LOMO_INLINE double lanes_total(const double* lanes, uint32_t& bad) {
  double total = 0.0;
  for (int l = 0; l < kSumLanes; ++l) total += lanes[l];
  bad |= std::isfinite(total) ? 0u : 1u;
  return total;
}

template <class G>
double sumsq_span(const typename G::T* __restrict grad, int64_t n, float inv_scale,
                  uint32_t& bad) {
  double lanes[kSumLanes] = {};
  int64_t i = 0;
#if LOMO_LOOPS_AVX2
  static_assert(kSumLanes == 8, "sumsq_lanes_avx2 keeps eight lanes");
  i = sumsq_lanes_avx2<G>(grad, n, inv_scale, lanes);
#endif
  for (; i + kSumLanes <= n; i += kSumLanes) {
    for (int l = 0; l < kSumLanes; ++l) {
      const double v = lomo::mul_rn(G::load(grad[i + l]), inv_scale);
      lanes[l] += v * v;
    }
  }
  for (int l = 0; i < n; ++i, ++l) {
    const double v = lomo::mul_rn(G::load(grad[i]), inv_scale);
    lanes[l] += v * v;
  }
  return lanes_total(lanes, bad);
}

// lomo::pair_bits16 of the 32 elements from the flat index (hi << 32 | first), first a multiple
// of 32: one hash per pair of elements l and l + 16, its halves in the order pair_bits16 gives
// them.
LOMO_INLINE void pair_bits32(uint32_t first, uint32_t hi, uint32_t key, uint32_t* random) {
  const bool swap = (key & 16u) != 0;
  const uint32_t input = lomo::pair_input(first ^ key, hi);
  for (uint32_t l = 0; l < 16; ++l) {
    const uint32_t h = lomo::mix32(input ^ l);
    random[l] = swap ? h >> 16 : h & 0xFFFFu;
    random[l + 16] = swap ? h & 0xFFFFu : h >> 16;
  }
}

// accumulate_span's run over the chunk's elements [i, stop), whose flat indices (from `first`,
// a multiple of 32) share their high half: the level's vector loop, then the portable one.
// Element k of the chunk is measured into lane k % kSumLanes, so the squares' total is
// sumsq_span's of the written chunk bit for bit wherever the run starts: the run measures
// its element 8m + l into its lane l of `turned`, the chunk's lanes turned by i % 8 (none
// to nearest, where a chunk is one run from 0), which keeps every loop's lane a constant.
template <class P, class G, bool kFirst, bool kStochastic, Measure kMeasure, class One>
LOMO_INLINE void accumulate_run(typename P::T* __restrict b, const typename G::T* __restrict g,
                                int64_t i, int64_t stop, int64_t first, uint32_t key,
                                float inv_scale, double* lanes, uint32_t& largest, One&& one) {
  const uint32_t lo = static_cast<uint32_t>(first), hi = static_cast<uint32_t>(first >> 32);
  const int64_t n = stop - i;
  double turned[kSumLanes];
  for (int l = 0; l < kSumLanes; ++l) turned[l] = lanes[(i + l) % kSumLanes];
  int64_t done = 0;
#if LOMO_LOOPS_AVX512
  done = accumulate_avx512<P, G, kFirst, kStochastic, kMeasure>(b + i, g + i, n, lo, hi, key,
                                                                inv_scale, turned, largest);
#elif LOMO_LOOPS_AVX2
  done = accumulate_avx2<P, G, kFirst, kStochastic, kMeasure>(b + i, g + i, n, lo, hi, key,
                                                              inv_scale, turned, largest);
#endif
  // The portable loop: stochastically blocks of 32, one hash per pair of elements l and
  // l + 16, its halves in the order pair_bits16 gives them; then a hash per element.
  if constexpr (kStochastic) {
    for (; done + 32 <= n; done += 32) {
      uint32_t random[32];
      pair_bits32(lo + static_cast<uint32_t>(done), hi, key, random);
      for (int k = 0; k < 32; k += kSumLanes) {
        for (int l = 0; l < kSumLanes; ++l) one(i + done + k + l, turned, l, random[k + l]);
      }
    }
  }
  const auto bits = [&](int64_t k) {
    return kStochastic ? lomo::pair_bits16(lo + static_cast<uint32_t>(k), hi, key) : 0u;
  };
  for (; done + kSumLanes <= n; done += kSumLanes) {
    for (int l = 0; l < kSumLanes; ++l) one(i + done + l, turned, l, bits(done + l));
  }
  for (int l = 0; done < n; ++done, ++l) one(i + done, turned, l, bits(done));
  for (int l = 0; l < kSumLanes; ++l) lanes[(i + l) % kSumLanes] = turned[l];
}

// One chunk of grad_accumulate_: elements [begin, begin + n) of buffer and grad, whose flat
// index in the parameter is offset + begin. Stores round(buffer + grad) (kFirst:
// round(grad), the buffer not read) to nearest even or stochastically with the
// accumulation's bits (lomo::pair_bits16; the vector loops draw them 32 elements at a time
// from a multiple of 32 of the flat index: the elements before the first one take a hash
// each). kSquares returns sumsq_span of the stored values (the same lanes, order and flag:
// grad_sumsq_ of the written chunk, bit for bit); kFlag sets only that flag, from the
// largest stored magnitude (fp32 rounding is monotone, so its product with inv_scale is
// inf/nan exactly when one of theirs is); both others return 0.
template <class P, class G, bool kFirst, bool kStochastic, Measure kMeasure>
double accumulate_span(typename P::T* buffer, const typename G::T* grad, int64_t offset,
                       int64_t begin, int64_t n, float inv_scale, uint32_t key, uint32_t& bad) {
  typename P::T* __restrict b = buffer + begin;
  const typename G::T* __restrict g = grad + begin;
  const int64_t start = offset + begin;  // the flat index of element 0 of the chunk
  double lanes[kSumLanes] = {};
  uint32_t largest = 0;  // kFlag: the fp32 bits of the largest stored magnitude
  // Element k of the chunk, stored with `random` (16 bits; unused to nearest) and measured
  // into sums[lane].
  const auto one = [&](int64_t k, double* sums, int lane, uint32_t random) {
    const float gv = G::load(g[k]);
    const float v = kFirst ? gv : lomo::add_rn(P::load(b[k]), gv);
    typename P::T out;
    if constexpr (kStochastic) {
      out = P::round_sr(v, random);
    } else {
      out = P::round(v);
    }
    b[k] = out;
    if constexpr (kMeasure == Measure::kSquares) {
      const double stored = lomo::mul_rn(P::load(out), inv_scale);
      sums[lane] += stored * stored;
    }
    if constexpr (kMeasure == Measure::kFlag) {
      largest = std::max(largest, lomo::bits_of(P::load(out)) & 0x7FFFFFFFu);
    }
  };
  // The elements before the first multiple of 32 of the flat index (a slice's head).
  int64_t i = 0;
  if constexpr (kStochastic) {
    for (; i < n && (start + i) % 32 != 0; ++i) {
      const uint64_t index = static_cast<uint64_t>(start + i);
      one(i, lanes, static_cast<int>(i % kSumLanes),
          lomo::pair_bits16(static_cast<uint32_t>(index), static_cast<uint32_t>(index >> 32),
                            key));
    }
  }
  while (i < n) {
    const int64_t stop = kStochastic ? same_high_half_end(start, i, n) : n;
    accumulate_run<P, G, kFirst, kStochastic, kMeasure>(b, g, i, stop, start + i, key, inv_scale,
                                                        lanes, largest, one);
    i = stop;
  }
  if constexpr (kMeasure == Measure::kSquares) return lanes_total(lanes, bad);
  if constexpr (kMeasure == Measure::kFlag) {
    bad |= std::isfinite(lomo::mul_rn(lomo::float_of(largest), inv_scale)) ? 0u : 1u;
  }
  return 0.0;
}

#include "lomo_cpu_int8.h"
