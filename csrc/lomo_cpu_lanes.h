// The vector lanes of the hand-written LOMO loops, and what those loops compute the same way at
// either width: part of lomo_cpu_loops.h, compiled for the AVX2 and AVX-512 levels only (see
// there). Lanes8 is 8 fp32/uint32 lanes of AVX2 (+F16C), Lanes16 16 of AVX-512; each maps the
// operations below onto its instructions, so the hash, fp16's stochastic rounding and the fp16
// stochastic-rounding loop are written once and run 8 or 16 lanes wide.

// One non-temporal prefetch per stream and 64 bytes, kPrefetchBytes ahead: measured on an
// AVX2-only AMD EPYC (per-thread CPU time, interleaved with an in-place axpy moving the same
// bytes, 4M and 16M fp32) about 1.02x the axpy's time against about 1.10x with the AVX-512
// loops' PREFETCHW/T0 hints, and 1.5x without any.
LOMO_INLINE void prefetch_streams(const void* p, const void* g) {
  _mm_prefetch(static_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_NTA);
  _mm_prefetch(static_cast<const char*>(g) + kPrefetchBytes, _MM_HINT_NTA);
}

struct Lanes8 {
  static constexpr int kCount = 8;
  using Int = __m256i;
  using Float = __m256;
  using Mask = __m256i;    // all-ones lanes
  using Halves = __m128i;  // kCount fp16 values
  static LOMO_INLINE Int set1(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
  static LOMO_INLINE Int iota() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
  static LOMO_INLINE Int add(Int a, Int b) { return _mm256_add_epi32(a, b); }
  static LOMO_INLINE Int sub(Int a, Int b) { return _mm256_sub_epi32(a, b); }
  static LOMO_INLINE Int mul(Int a, Int b) { return _mm256_mullo_epi32(a, b); }
  static LOMO_INLINE Int min_u(Int a, Int b) { return _mm256_min_epu32(a, b); }
  static LOMO_INLINE Int max_signed(Int a, Int b) { return _mm256_max_epi32(a, b); }
  static LOMO_INLINE Int bit_and(Int a, Int b) { return _mm256_and_si256(a, b); }
  static LOMO_INLINE Int and_not(Int a, Int b) { return _mm256_andnot_si256(a, b); }
  static LOMO_INLINE Int bit_or(Int a, Int b) { return _mm256_or_si256(a, b); }
  static LOMO_INLINE Int bit_xor(Int a, Int b) { return _mm256_xor_si256(a, b); }
  static LOMO_INLINE Int shr(Int a, int k) { return _mm256_srli_epi32(a, k); }
  static LOMO_INLINE Int shl(Int a, int k) { return _mm256_slli_epi32(a, k); }
  static LOMO_INLINE Int shr_each(Int a, Int k) { return _mm256_srlv_epi32(a, k); }
  static LOMO_INLINE Int shl_each(Int a, Int k) { return _mm256_sllv_epi32(a, k); }
  static LOMO_INLINE Int bits(Float a) { return _mm256_castps_si256(a); }
  static LOMO_INLINE Float from_bits(Int a) { return _mm256_castsi256_ps(a); }
  static LOMO_INLINE Float to_float(Int a) { return _mm256_cvtepi32_ps(a); }
  static LOMO_INLINE Float mul(Float a, Float b) { return _mm256_mul_ps(a, b); }
  static LOMO_INLINE Float set1(float x) { return _mm256_set1_ps(x); }
  // a > b, signed; of magnitudes (below 2^31), where AVX2's signed compare orders them too.
  static LOMO_INLINE Mask greater(Int a, Int b) { return _mm256_cmpgt_epi32(a, b); }
  static LOMO_INLINE Mask greater_magnitude(Int a, Int b) { return _mm256_cmpgt_epi32(a, b); }
  static LOMO_INLINE Mask either(Mask a, Mask b) { return _mm256_or_si256(a, b); }
  static LOMO_INLINE bool any(Mask m) { return !_mm256_testz_si256(m, m); }
  // m ? a : b, lane by lane.
  static LOMO_INLINE Int select(Mask m, Int a, Int b) { return _mm256_blendv_epi8(b, a, m); }
  static LOMO_INLINE Halves load_halves(const uint16_t* p) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  }
  static LOMO_INLINE void store_halves(uint16_t* p, Halves h) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
  }
  static LOMO_INLINE Float widen(Halves h) { return _mm256_cvtph_ps(h); }
  template <int kRounding>
  static LOMO_INLINE Halves narrow(Float f) {
    return _mm256_cvtps_ph(f, kRounding);
  }
  static LOMO_INLINE void prefetch(const void* p, const void* g) { prefetch_streams(p, g); }
  // max(top, |stored|) lane by lane, of the fp32 (Int) or fp16 (Halves) bits read unsigned,
  // which order magnitudes as their values do (finite < inf < nan); and the largest lane.
  static LOMO_INLINE Int max_magnitude(Int top, Float stored) {
    return _mm256_max_epu32(top, _mm256_and_si256(bits(stored), set1(0x7FFFFFFFu)));
  }
  static LOMO_INLINE Halves max_magnitude(Halves top, Halves stored) {
    return _mm_max_epu16(top, _mm_and_si128(stored, _mm_set1_epi16(0x7FFF)));
  }
  static LOMO_INLINE uint32_t largest(Int top) {
    alignas(32) uint32_t lanes[kCount];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), top);
    return *std::max_element(lanes, lanes + kCount);
  }
  static LOMO_INLINE uint32_t largest(Halves top) {
    return largest(_mm256_cvtepu16_epi32(top));
  }
};

#if LOMO_LOOPS_AVX512
struct Lanes16 {
  static constexpr int kCount = 16;
  using Int = __m512i;
  using Float = __m512;
  using Mask = __mmask16;
  using Halves = __m256i;
  static LOMO_INLINE Int set1(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
  static LOMO_INLINE Int iota() {
    return _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  }
  static LOMO_INLINE Int add(Int a, Int b) { return _mm512_add_epi32(a, b); }
  static LOMO_INLINE Int sub(Int a, Int b) { return _mm512_sub_epi32(a, b); }
  static LOMO_INLINE Int mul(Int a, Int b) { return _mm512_mullo_epi32(a, b); }
  static LOMO_INLINE Int min_u(Int a, Int b) { return _mm512_min_epu32(a, b); }
  static LOMO_INLINE Int max_signed(Int a, Int b) { return _mm512_max_epi32(a, b); }
  static LOMO_INLINE Int bit_and(Int a, Int b) { return _mm512_and_si512(a, b); }
  static LOMO_INLINE Int and_not(Int a, Int b) { return _mm512_andnot_si512(a, b); }
  static LOMO_INLINE Int bit_or(Int a, Int b) { return _mm512_or_si512(a, b); }
  static LOMO_INLINE Int bit_xor(Int a, Int b) { return _mm512_xor_si512(a, b); }
  static LOMO_INLINE Int shr(Int a, int k) { return _mm512_srli_epi32(a, k); }
  static LOMO_INLINE Int shl(Int a, int k) { return _mm512_slli_epi32(a, k); }
  static LOMO_INLINE Int shr_each(Int a, Int k) { return _mm512_srlv_epi32(a, k); }
  static LOMO_INLINE Int shl_each(Int a, Int k) { return _mm512_sllv_epi32(a, k); }
  static LOMO_INLINE Int bits(Float a) { return _mm512_castps_si512(a); }
  static LOMO_INLINE Float from_bits(Int a) { return _mm512_castsi512_ps(a); }
  static LOMO_INLINE Float to_float(Int a) { return _mm512_cvtepi32_ps(a); }
  static LOMO_INLINE Float mul(Float a, Float b) { return _mm512_mul_ps(a, b); }
  static LOMO_INLINE Float set1(float x) { return _mm512_set1_ps(x); }
  static LOMO_INLINE Mask greater(Int a, Int b) { return _mm512_cmpgt_epi32_mask(a, b); }
  static LOMO_INLINE Mask greater_magnitude(Int a, Int b) {
    return _mm512_cmpgt_epu32_mask(a, b);
  }
  static LOMO_INLINE Mask either(Mask a, Mask b) { return a | b; }
  static LOMO_INLINE bool any(Mask m) { return m != 0; }
  static LOMO_INLINE Int select(Mask m, Int a, Int b) { return _mm512_mask_mov_epi32(b, m, a); }
  static LOMO_INLINE Halves load_halves(const uint16_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  static LOMO_INLINE void store_halves(uint16_t* p, Halves h) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
  }
  static LOMO_INLINE Float widen(Halves h) { return _mm512_cvtph_ps(h); }
  template <int kRounding>
  static LOMO_INLINE Halves narrow(Float f) {
    return _mm512_cvtps_ph(f, kRounding);
  }
  static LOMO_INLINE void prefetch(const void* p, const void* g) { prefetch_ahead(p, g); }
  static LOMO_INLINE Int max_magnitude(Int top, Float stored) {
    return _mm512_max_epu32(top, _mm512_and_si512(bits(stored), set1(0x7FFFFFFFu)));
  }
  static LOMO_INLINE Halves max_magnitude(Halves top, Halves stored) {
    return _mm256_max_epu16(top, _mm256_and_si256(stored, _mm256_set1_epi16(0x7FFF)));
  }
  static LOMO_INLINE uint32_t largest(Int top) { return _mm512_reduce_max_epu32(top); }
  static LOMO_INLINE uint32_t largest(Halves top) {
    return _mm512_reduce_max_epu32(_mm512_cvtepu16_epi32(top));
  }
};
#endif

// lomo::mix32 on every lane.
template <class V>
LOMO_INLINE typename V::Int mix32_lanes(typename V::Int x) {
  x = V::bit_xor(x, V::shr(x, 16));
  x = V::mul(x, V::set1(0x7FEB352Du));
  x = V::bit_xor(x, V::shr(x, 15));
  x = V::mul(x, V::set1(0x846CA68Bu));
  return V::bit_xor(x, V::shr(x, 16));
}

// random_bits16 on every lane up to its last multiply: bits 16..31 of the result are the 16
// random bits (mix32's final x ^= x >> 16 leaves them as they are), so callers shift once, by
// 16, or by 19 for the 13 bits below fp16's mantissa. index: the low 32 bits of each lane's
// flat element index; key, hi: as random_bits16 takes them.
template <class V>
LOMO_INLINE typename V::Int random_product(typename V::Int index, typename V::Int key,
                                           typename V::Int hi) {
  typename V::Int x = V::bit_xor(mix32_lanes<V>(V::bit_xor(index, key)), hi);
  x = V::mul(V::bit_xor(x, V::shr(x, 16)), V::set1(0x7FEB352Du));
  return V::mul(V::bit_xor(x, V::shr(x, 15)), V::set1(0x846CA68Bu));
}

// Lanes whose fp32 magnitude lies outside fp16's normal range [2^-14, 65504] (subnormal
// results, overflow, inf, nan), where fp16_sr_value is not just "add and truncate": with the
// sign shifted out, 2|x| + (2^31 - 2 * kFp16MinNormalBits) maps that range onto the lowest
// signed values, so one signed compare finds the rest.
constexpr uint32_t kFp16NormalShift = 0x80000000u - 2u * lomo::kFp16MinNormalBits;
constexpr uint32_t kFp16NormalTop =
    0x80000000u + 2u * (lomo::kFp16MaxBits - lomo::kFp16MinNormalBits);

template <class V>
LOMO_INLINE typename V::Int fp16_normal_key(typename V::Float u) {
  return V::add(V::shl(V::bits(u), 1), V::set1(kFp16NormalShift));
}

template <class V>
LOMO_INLINE typename V::Mask fp16_outside_normal(typename V::Float u) {
  return V::greater(fp16_normal_key<V>(u), V::set1(kFp16NormalTop));
}

// lomo::fp16_sr_value on every lane: the stochastically rounded value on the fp16 grid (fp32),
// or u itself beyond 65504 (inf, nan), so a nearest conversion stores the reference's bits.
// The subnormal count is only formed for a vector with a lane below 2^-14 (rare for
// parameters).
template <class V>
LOMO_INLINE typename V::Float fp16_sr_value(typename V::Float u, typename V::Int random) {
  using Int = typename V::Int;
  const Int b = V::bits(u);
  const Int abs_mask = V::set1(0x7FFFFFFFu);
  const Int mag = V::bit_and(b, abs_mask);
  Int out = V::bit_and(V::add(mag, V::shr(random, 3)), V::set1(~0x1FFFu));
  const typename V::Mask small = V::greater_magnitude(V::set1(lomo::kFp16MinNormalBits), mag);
  if (__builtin_expect(V::any(small), 0)) {
    // fp16_subnormal_count_sr: q17 = m >> (109 - e) or m << (e - 109) (a count outside
    // [0, 31], the other shift's, wrapped, gives 0), then (q17 + 2 random + 1 - tie) >> 17,
    // tie = an odd random and no bit of m dropped by a right shift (a shift by 24 or more
    // drops them all, as nonzero as m).
    const Int e = V::min_u(V::shr(mag, 23), V::set1(112u));
    const Int m = V::bit_or(V::bit_and(mag, V::set1(0x007FFFFFu)), V::set1(0x00800000u));
    const Int e0 = V::set1(109u);
    const Int q17 = V::bit_or(V::shr_each(m, V::sub(e0, e)), V::shl_each(m, V::sub(e, e0)));
    const Int right = V::sub(e0, V::min_u(e, e0));
    const Int dropped = V::bit_and(m, V::sub(V::shl_each(V::set1(1u), right), V::set1(1u)));
    const Int inexact = V::shr(V::bit_or(dropped, V::sub(V::set1(0u), dropped)), 31);
    const Int tie = V::and_not(inexact, V::bit_and(random, V::set1(1u)));
    const Int centred = V::bit_or(V::shl(random, 1), V::set1(1u));
    const Int count = V::shr(V::sub(V::add(q17, centred), tie), 17);
    const typename V::Float value =
        V::mul(V::to_float(count), V::set1(5.9604644775390625e-8f));  // * 2^-24, exact
    out = V::select(small, V::bits(value), out);
  }
  out = V::bit_or(out, V::and_not(abs_mask, b));  // the sign
  const typename V::Mask big = V::greater_magnitude(mag, V::set1(lomo::kFp16MaxBits));
  return V::from_bits(V::select(big, b, out));
}

// fp16 parameter and gradient with stochastic rounding, V::kCount elements per step (32 per
// trip of prefetches): update(g, p, bad) gives the updated fp32 values (bad: the lanes with an
// inf/nan gradient), then they are put on the fp16 grid. In fp16's normal range (the common
// case) that is random16 >> 3 added to the bits (no carry into the sign) and a conversion that
// truncates, which drops exactly the low 13 mantissa bits; a step with any other value takes
// fp16_sr_value (exact values, converted to nearest), one with an inf/nan gradient the element
// loop, which keeps the old halves. Each step is stored at once, so few vectors stay live.
template <class V, class Update>
uint32_t update_fp16_sr(uint16_t* __restrict p, const uint16_t* __restrict g, int64_t n,
                        uint32_t lo, uint32_t hi, const lomo::LomoScalars& s, uint32_t key,
                        Update update) {
  using Int = typename V::Int;
  const Int key_v = V::set1(key);
  const Int hi_v = V::set1(hi);
  const Int step = V::set1(static_cast<uint32_t>(V::kCount));
  // No wrap: update_span keeps a block inside one 2^32 range of indices.
  Int index = V::add(V::set1(lo), V::iota());
  uint32_t any_bad = 0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    V::prefetch(p + i, g + i);
    for (int64_t k = i; k < i + 32; k += V::kCount, index = V::add(index, step)) {
      const typename V::Halves old = V::load_halves(p + k);
      typename V::Mask bad;
      const typename V::Float u = update(V::widen(V::load_halves(g + k)), V::widen(old), bad);
      const Int product = random_product<V>(index, key_v, hi_v);
      typename V::Halves out;
      if (__builtin_expect(!V::any(V::either(bad, fp16_outside_normal<V>(u))), 1)) {
        const Int sum = V::add(V::bits(u), V::shr(product, 19));
        out = V::template narrow<_MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC>(V::from_bits(sum));
      } else if (V::any(bad)) {
        any_bad |= update_elements<lomo::Fp16, lomo::Fp16, true>(
            p + k, g + k, V::kCount, lo + static_cast<uint32_t>(k), hi, s, key);
        continue;
      } else {
        out = V::template narrow<_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC>(
            fp16_sr_value<V>(u, V::shr(product, 16)));
      }
      V::store_halves(p + k, out);
    }
  }
  return any_bad | update_elements<lomo::Fp16, lomo::Fp16, true>(
                       p + i, g + i, n - i, lo + static_cast<uint32_t>(i), hi, s, key);
}
