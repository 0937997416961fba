// The vector loops of grad_accumulate_ (buffer += gradient, rounded into the buffer's dtype,
// with the stored values' sum of squares): part of lomo_cpu_loops.h, compiled for the AVX2
// and AVX-512 levels only (see there), after lomo_cpu_lanes.h and lomo_cpu_avx2.h.
//
// Stochastic rounding draws the accumulation's own stream (lomo::pair_bits16): one mix32 per
// pair of elements 16 apart, so a vector of 16 hashes serves a block of 32 elements: its low
// halves are the bits of elements 0-15 and its high halves those of elements 16-31 (the other
// way round for a key with bit 4 set), each already in its element's lane.

// 64 bytes of each stream per prefetch, kPrefetchBytes ahead, over a trip of `count`
// elements (the hint of prefetch_streams, lomo_cpu_lanes.h).
template <class P, class G, int64_t kCount>
LOMO_INLINE void prefetch_trip(const typename P::T* b, const typename G::T* g) {
  for (int64_t k = 0; k < kCount * static_cast<int64_t>(sizeof(typename P::T)); k += kLineBytes) {
    _mm_prefetch(reinterpret_cast<const char*>(b) + kPrefetchBytes + k, _MM_HINT_NTA);
  }
  for (int64_t k = 0; k < kCount * static_cast<int64_t>(sizeof(typename G::T)); k += kLineBytes) {
    _mm_prefetch(reinterpret_cast<const char*>(g) + kPrefetchBytes + k, _MM_HINT_NTA);
  }
}

// lomo::mix32_product on every lane: a block's hashes are mix32_product_lanes of
// lomo::pair_block_input ^ l (l = 0 .. 15), then y ^ (y >> 16).
template <class V>
LOMO_INLINE typename V::Int mix32_product_lanes(typename V::Int x) {
  x = V::mul(x, V::set1(0x7FEB352Du));
  x = V::bit_xor(x, V::shr(x, 15));
  return V::mul(x, V::set1(0x846CA68Bu));
}

// ----------------------------------------------------------------------------------------
// 8 lanes (AVX2)

// lomo::pair_bits16 of the 32 elements from the flat index `first`, a multiple of 32 (no
// wrap), 16 bits per lane in r[0] .. r[3] (elements 0-7, 8-15, 16-23, 24-31).
struct PairRandom8 {
  uint32_t key, hi;
  bool swap;  // a key with bit 4 set: elements 0-15 take the high halves
  PairRandom8(uint32_t key_value, uint32_t hi_value)
      : key(key_value), hi(hi_value), swap((key_value & 16u) != 0) {}
  LOMO_INLINE void bits(uint32_t first, __m256i* r) const {
    const __m256i input = _mm256_xor_si256(Lanes8::set1(lomo::pair_block_input(first, hi, key)),
                                           Lanes8::iota());
    for (int k = 0; k < 2; ++k) {
      const __m256i eight = _mm256_set1_epi32(8 * k);
      const __m256i y = mix32_product_lanes<Lanes8>(_mm256_xor_si256(input, eight));
      const __m256i high = _mm256_srli_epi32(y, 16);
      const __m256i low = _mm256_and_si256(_mm256_xor_si256(y, high), _mm256_set1_epi32(0xFFFF));
      r[k] = swap ? high : low;
      r[k + 2] = swap ? low : high;
    }
  }
};

// lomo::f32_to_fp16_sr on every lane with `random` (16 bits per lane): the fp16 bits, and in
// `stored` their fp32 values. In fp16's normal range (the common case) random >> 3 is added to
// the fp32 bits (no carry into the sign) and the low 13 mantissa bits cleared, which leaves
// the stored value itself, converted exactly; a vector with any other value converts
// fp16_sr_value's exact values to nearest (as update_fp16_sr).
template <class V>
LOMO_INLINE typename V::Halves fp16_sr_halves(typename V::Float u, typename V::Int random,
                                              typename V::Float& stored) {
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  if (__builtin_expect(!V::any(fp16_outside_normal<V>(u)), 1)) {
    const typename V::Int sum = V::add(V::bits(u), V::shr(random, 3));
    stored = V::from_bits(V::bit_and(sum, V::set1(~0x1FFFu)));
    return V::template narrow<kNearest>(stored);
  }
  const typename V::Halves halves = V::template narrow<kNearest>(fp16_sr_value<V>(u, random));
  stored = V::widen(halves);
  return halves;
}

// fp16 bits of every lane, to nearest or stochastically (fp16_sr_halves), and their values.
template <class V, bool kStochastic>
LOMO_INLINE typename V::Halves fp16_halves(typename V::Float u, typename V::Int random,
                                           typename V::Float& stored) {
  if constexpr (kStochastic) {
    return fp16_sr_halves<V>(u, random, stored);
  } else {
    const typename V::Halves halves =
        V::template narrow<_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC>(u);
    stored = V::widen(halves);
    return halves;
  }
}

// lomo::f32_to_bf16_sr on 8 lanes with `random` (16 bits per lane): the stored bf16 in the
// high half, the low half cleared. inf needs no exception (its low 16 bits are zero, so the
// addition cannot carry); nan lanes take the quiet nan of the unperturbed bits.
LOMO_INLINE __m256i bf16_sr8(__m256 u, __m256i random) {
  const __m256i b = _mm256_castps_si256(u);
  const __m256i quiet = _mm256_or_si256(b, _mm256_set1_epi32(0x00400000));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(u, u, _CMP_UNORD_Q));
  const __m256i out = _mm256_blendv_epi8(_mm256_add_epi32(b, random), quiet, nan);
  return _mm256_and_si256(out, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
}

// Stores 8 fp32 values at dst in P's dtype (to nearest, or stochastically with `random`, 16
// bits per lane) and returns what was stored, widened back to fp32 exactly. bf16:
// bf16_rne_high8 / bf16_sr8 (the high halves are the stored values), packed in order;
// fp16: F16C's nearest conversion, after fp16_sr_value for stochastic rounding.
template <class P, bool kStochastic>
LOMO_INLINE __m256 store_accumulated8(typename P::T* dst, __m256 u, __m256i random) {
  if constexpr (std::is_same_v<P, lomo::Fp32>) {
    _mm256_storeu_ps(dst, u);
    return u;
  } else if constexpr (std::is_same_v<P, lomo::Fp16>) {
    __m256 stored;
    Lanes8::store_halves(dst, fp16_halves<Lanes8, kStochastic>(u, random, stored));
    return stored;
  } else {
    const __m256i high = kStochastic ? bf16_sr8(u, random) : bf16_rne_high8(u);
    // Words 0-3 and 4-7 land in the low quadword of each 128-bit lane: gather those two.
    const __m256i words = _mm256_packus_epi32(_mm256_srli_epi32(high, 16), _mm256_setzero_si256());
    Lanes8::store_halves(dst, _mm256_castsi256_si128(_mm256_permute4x64_epi64(words, 0x08)));
    return _mm256_castsi256_ps(high);
  }
}

// accumulate_span's vector loop over the first elements of [0, n) from the flat index lo, a
// multiple of 32: 32 elements per trip (one PairRandom8 draw, a prefetch per 64 bytes of each
// stream), 8 lanes at a time (any dtype pair: load_floats8 widens each exactly), the sum of
// squares of the stored values in sumsq_span's lanes (element 8k + l into lane l), so the
// total is grad_sumsq_'s of the written buffer bit for bit. Returns the elements done (a
// multiple of 32).
template <class P, class G, bool kFirst, bool kStochastic, bool kMeasure>
int64_t accumulate_avx2(typename P::T* __restrict b, const typename G::T* __restrict g,
                        int64_t n, uint32_t lo, uint32_t hi, uint32_t key, float inv_scale,
                        double* lanes) {
  const PairRandom8 random(key, hi);
  const __m256 inv = _mm256_set1_ps(inv_scale);
  __m256d low = _mm256_loadu_pd(lanes), high = _mm256_loadu_pd(lanes + 4);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    prefetch_trip<P, G, 32>(b + i, g + i);
    __m256i r[4] = {};
    if constexpr (kStochastic) random.bits(lo + static_cast<uint32_t>(i), r);
    for (int part = 0; part < 4; ++part) {
      const int64_t e = i + 8 * part;
      __m256 u = load_floats8<G>(g + e);
      if constexpr (!kFirst) u = _mm256_add_ps(load_floats8<P>(b + e), u);
      const __m256 stored = store_accumulated8<P, kStochastic>(b + e, u, r[part]);
      if constexpr (kMeasure) add_squares8(stored, inv, low, high);
    }
  }
  _mm256_storeu_pd(lanes, low);
  _mm256_storeu_pd(lanes + 4, high);
  return i;
}

#if LOMO_LOOPS_AVX512
// ----------------------------------------------------------------------------------------
// 16 lanes (AVX-512)

// lomo::pair_bits16 of the 32 elements from the flat index `first`, a multiple of 32 (no
// wrap): elements 0-15 in r0, 16-31 in r1, 16 bits per lane.
struct PairRandom16 {
  uint32_t key, hi;
  bool swap;  // a key with bit 4 set: elements 0-15 take the high halves
  PairRandom16(uint32_t key_value, uint32_t hi_value)
      : key(key_value), hi(hi_value), swap((key_value & 16u) != 0) {}
  LOMO_INLINE void bits(uint32_t first, __m512i& r0, __m512i& r1) const {
    const __m512i y = mix32_product_lanes<Lanes16>(
        _mm512_xor_si512(Lanes16::set1(lomo::pair_block_input(first, hi, key)), Lanes16::iota()));
    const __m512i high = _mm512_srli_epi32(y, 16);
    // (y ^ high) & 0xFFFF in one instruction.
    const __m512i low = _mm512_ternarylogic_epi32(y, high, _mm512_set1_epi32(0xFFFF), 0x28);
    r0 = swap ? high : low;
    r1 = swap ? low : high;
  }
};

// bf16_sr8 on 16 lanes, the low half of each lane left as the addition leaves it.
LOMO_INLINE __m512i bf16_sr16(__m512 u, __m512i random) {
  const __m512i b = _mm512_castps_si512(u);
  const __mmask16 nan = _mm512_cmp_ps_mask(u, u, _CMP_UNORD_Q);
  return _mm512_mask_or_epi32(_mm512_add_epi32(b, random), nan, b, _mm512_set1_epi32(0x00400000));
}

// Sixteen elements, in order, as fp32: the dtype's values widened exactly.
template <class G>
LOMO_INLINE __m512 load_floats16(const typename G::T* g) {
  if constexpr (std::is_same_v<G, lomo::Fp32>) {
    return _mm512_loadu_ps(g);
  } else {
    const __m256i h = Lanes16::load_halves(g);
    if constexpr (std::is_same_v<G, lomo::Fp16>) {
      return Lanes16::widen(h);
    } else {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
  }
}

// The squares of 16 consecutive values times inv in double, added into sumsq_span's 8 lanes:
// elements 0-7, then 8-15 (element 16k + l and 16k + 8 + l into lane l, in order).
LOMO_INLINE void add_squares16(__m512 values, __m512 inv, __m512d& acc) {
  const __m512 v = _mm512_mul_ps(values, inv);
  const __m512d a = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
  const __m512d c = _mm512_cvtps_pd(_mm512_extractf32x8_ps(v, 1));
  acc = _mm512_add_pd(acc, _mm512_mul_pd(a, a));
  acc = _mm512_add_pd(acc, _mm512_mul_pd(c, c));
}

// 32 fp32 values (u0: elements 0-15, u1: 16-31) stored at dst in P's dtype as
// store_accumulated8 stores them; s0, s1: the stored values widened back to fp32. bf16: one
// vpermt2w takes the 32 high words in element order.
template <class P, bool kStochastic>
LOMO_INLINE void store_accumulated32(typename P::T* dst, __m512 u0, __m512 u1, __m512i r0,
                                     __m512i r1, __m512& s0, __m512& s1) {
  if constexpr (std::is_same_v<P, lomo::Fp32>) {
    _mm512_storeu_ps(dst, u0);
    _mm512_storeu_ps(dst + 16, u1);
    s0 = u0;
    s1 = u1;
  } else if constexpr (std::is_same_v<P, lomo::Fp16>) {
    Lanes16::store_halves(dst, fp16_halves<Lanes16, kStochastic>(u0, r0, s0));
    Lanes16::store_halves(dst + 16, fp16_halves<Lanes16, kStochastic>(u1, r1, s1));
  } else {
    const __m512i zero = _mm512_setzero_si512();
    const __m512i w0 = kStochastic ? bf16_sr16(u0, r0) : bf16_rne_high_vector(u0, zero, 0);
    const __m512i w1 = kStochastic ? bf16_sr16(u1, r1) : bf16_rne_high_vector(u1, zero, 0);
    // Word 2e + 1 of (w0, w1) is element e's bf16.
    const __m512i odd_words = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41,
                                               39, 37, 35, 33, 31, 29, 27, 25, 23, 21, 19, 17,
                                               15, 13, 11, 9, 7, 5, 3, 1);
    _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(w0, odd_words, w1));
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    s0 = _mm512_castsi512_ps(_mm512_and_si512(w0, high));
    s1 = _mm512_castsi512_ps(_mm512_and_si512(w1, high));
  }
}

// accumulate_avx2 on 16 lanes (lo a multiple of 32): 32 elements per step (one PairRandom16
// draw), the sum of squares in sumsq_span's lanes as add_squares16 adds them. Returns the
// elements done (a multiple of 32).
template <class P, class G, bool kFirst, bool kStochastic, bool kMeasure>
int64_t accumulate_avx512(typename P::T* __restrict b, const typename G::T* __restrict g,
                          int64_t n, uint32_t lo, uint32_t hi, uint32_t key, float inv_scale,
                          double* lanes) {
  const PairRandom16 random(key, hi);
  const __m512 inv = _mm512_set1_ps(inv_scale);
  __m512d acc = _mm512_loadu_pd(lanes);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    prefetch_trip<P, G, 32>(b + i, g + i);
    __m512 u0 = load_floats16<G>(g + i), u1 = load_floats16<G>(g + i + 16);
    if constexpr (!kFirst) {
      u0 = _mm512_add_ps(load_floats16<P>(b + i), u0);
      u1 = _mm512_add_ps(load_floats16<P>(b + i + 16), u1);
    }
    __m512i r0 = _mm512_setzero_si512(), r1 = r0;
    if constexpr (kStochastic) random.bits(lo + static_cast<uint32_t>(i), r0, r1);
    __m512 s0, s1;
    store_accumulated32<P, kStochastic>(b + i, u0, u1, r0, r1, s0, s1);
    if constexpr (kMeasure) {
      add_squares16(s0, inv, acc);
      add_squares16(s1, inv, acc);
    }
  }
  _mm512_storeu_pd(lanes, acc);
  return i;
}
#endif
