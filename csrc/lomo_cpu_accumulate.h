// The vector loops of grad_accumulate_ (buffer += gradient, rounded into the buffer's dtype,
// with the stored values' sum of squares): part of lomo_cpu_loops.h, compiled for the AVX2
// and AVX-512 levels only (see there), after lomo_cpu_lanes.h and lomo_cpu_avx2.h.
//
// Stochastic rounding draws the accumulation's own stream (lomo::pair_bits16): one mix32 per
// pair of elements 16 apart, so a vector of 16 hashes serves a block of 32 elements: its low
// halves are the bits of elements 0-15 and its high halves those of elements 16-31 (the other
// way round for a key with bit 4 set), each already in its element's lane.

// The largest magnitude stored so far, lane by lane: fp32 bits of fp32 and bf16 values, fp16
// bits of fp16 ones (no widening needed). What the flag alone (lomo::Measure::kFlag) tracks
// of the stored values, tested once per chunk; the squares' total is the flag otherwise.
template <class V>
struct TopMagnitude {
  typename V::Int values;
  typename V::Halves halves;
  TopMagnitude() : values(V::set1(0u)), halves{} {}
  LOMO_INLINE void add(typename V::Float stored) { values = V::max_magnitude(values, stored); }
  LOMO_INLINE void add(typename V::Halves stored) { halves = V::max_magnitude(halves, stored); }
  // The fp32 bits of the largest magnitude of all lanes.
  LOMO_INLINE uint32_t largest() const {
    const uint16_t half = static_cast<uint16_t>(V::largest(halves));
    return std::max(V::largest(values), lomo::bits_of(lomo::Fp16::load(half)));
  }
};

// Whether a value in fp16's normal range (at most 65504 in magnitude) times inv_scale can be
// inf/nan: fp32 rounding is monotone, so when 65504 * inv_scale is finite no such value can
// raise the flag and the flag need not look at them.
inline bool fp16_normal_may_flag(float inv_scale) {
  return !std::isfinite(lomo::mul_rn(65504.0f, inv_scale));
}

// What an accumulate loop of V's lanes measures of each vector of stored values (kMeasure):
// nothing, their largest magnitude, or their squares times inv in sumsq_span's lanes (laid
// out as `Squares` adds them: Squares8, Squares16).
template <class V, class Squares, Measure kMeasure>
struct Measured {
  typename V::Float inv;
  Squares squares;
  TopMagnitude<V> top;
  bool normal_may_flag;
  Measured(float inv_scale, const double* lanes)
      : inv(V::set1(inv_scale)), squares(lanes),
        normal_may_flag(fp16_normal_may_flag(inv_scale)) {}
  // Stored values as fp32; fp16 ones also as stored (`halves`), which the flag reads.
  LOMO_INLINE void stored(typename V::Float values) {
    if constexpr (kMeasure == Measure::kSquares) squares.add(values, inv);
    if constexpr (kMeasure == Measure::kFlag) top.add(values);
  }
  LOMO_INLINE void stored(typename V::Halves halves, typename V::Float values) {
    if constexpr (kMeasure == Measure::kSquares) squares.add(values, inv);
    if constexpr (kMeasure == Measure::kFlag) top.add(halves);
  }
  // fp16 values inside fp16's normal range (fp16_sr_normal's).
  LOMO_INLINE void stored_normal(typename V::Halves halves, typename V::Float values) {
    if (kMeasure != Measure::kFlag || normal_may_flag) stored(halves, values);
  }
  // Into accumulate_span's lanes, or its largest magnitude's fp32 bits.
  void finish(double* lanes, uint32_t& largest) const {
    if constexpr (kMeasure == Measure::kSquares) squares.store(lanes);
    if constexpr (kMeasure == Measure::kFlag) largest = std::max(largest, top.largest());
  }
};

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

// lomo::f32_to_fp16_sr on every lane of a vector inside fp16's normal range, with `random` (16
// bits per lane): random >> 3 added to the fp32 bits (no carry into the sign) and a truncating
// conversion, which drops exactly the low 13 mantissa bits, as clearing them gives `stored`
// (computed only where the squares use it).
template <class V>
LOMO_INLINE typename V::Halves fp16_sr_normal(typename V::Float u, typename V::Int random,
                                              typename V::Float& stored) {
  const typename V::Int sum = V::add(V::bits(u), V::shr(random, 3));
  stored = V::from_bits(V::bit_and(sum, V::set1(~0x1FFFu)));
  return V::template narrow<_MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC>(V::from_bits(sum));
}

// lomo::f32_to_fp16_sr on every lane: the fp16 bits, and in `stored` their fp32 values.
// fp16_sr_normal where every lane is in fp16's normal range (the common case); otherwise
// fp16_sr_value's exact values converted to nearest (as update_fp16_sr).
template <class V>
LOMO_INLINE typename V::Halves fp16_sr_halves(typename V::Float u, typename V::Int random,
                                              typename V::Float& stored) {
  if (__builtin_expect(!V::any(fp16_outside_normal<V>(u)), 1)) {
    return fp16_sr_normal<V>(u, random, stored);
  }
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const typename V::Halves halves = V::template narrow<kNearest>(fp16_sr_value<V>(u, random));
  stored = V::widen(halves);
  return halves;
}

// A trip's 32 values u[0 .. 32 / V::kCount) rounded stochastically to fp16, stored at dst in
// order and handed to `m`: one range test for the trip (the largest fp16_normal_key), then
// fp16_sr_normal for every vector; a trip with a value outside fp16's normal range takes
// fp16_sr_halves vector by vector.
template <class V, class Measured>
LOMO_INLINE void store_fp16_sr_trip(uint16_t* dst, const typename V::Float* u,
                                    const typename V::Int* random, Measured& m) {
  constexpr int kParts = 32 / V::kCount;
  typename V::Int key = fp16_normal_key<V>(u[0]);
  for (int k = 1; k < kParts; ++k) key = V::max_signed(key, fp16_normal_key<V>(u[k]));
  const bool normal = !V::any(V::greater(key, V::set1(kFp16NormalTop)));
  for (int k = 0; k < kParts; ++k) {
    typename V::Float stored;
    if (__builtin_expect(normal, 1)) {
      const typename V::Halves halves = fp16_sr_normal<V>(u[k], random[k], stored);
      V::store_halves(dst + k * V::kCount, halves);
      m.stored_normal(halves, stored);
    } else {
      const typename V::Halves halves = fp16_sr_halves<V>(u[k], random[k], stored);
      V::store_halves(dst + k * V::kCount, halves);
      m.stored(halves, stored);
    }
  }
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

// The squares in sumsq_span's lanes as add_squares8 adds them: lanes 0-3 (low), 4-7 (high).
struct Squares8 {
  __m256d low, high;
  explicit Squares8(const double* lanes)
      : low(_mm256_loadu_pd(lanes)), high(_mm256_loadu_pd(lanes + 4)) {}
  LOMO_INLINE void add(__m256 values, __m256 inv) { add_squares8(values, inv, low, high); }
  void store(double* lanes) const {
    _mm256_storeu_pd(lanes, low);
    _mm256_storeu_pd(lanes + 4, high);
  }
};
template <Measure kMeasure>
using Measured8 = Measured<Lanes8, Squares8, kMeasure>;

// Stores 8 fp32 values at dst in P's dtype (to nearest, or stochastically with `random`, 16
// bits per lane) and hands what was stored to `m`. bf16: bf16_rne_high8 / bf16_sr8 (the high
// halves are the stored values), packed in order; fp16: F16C's conversion (fp16_halves).
template <class P, bool kStochastic, class Measured>
LOMO_INLINE void store_accumulated8(typename P::T* dst, __m256 u, __m256i random, Measured& m) {
  if constexpr (std::is_same_v<P, lomo::Fp32>) {
    _mm256_storeu_ps(dst, u);
    m.stored(u);
  } else if constexpr (std::is_same_v<P, lomo::Fp16>) {
    __m256 stored;
    const __m128i halves = fp16_halves<Lanes8, kStochastic>(u, random, stored);
    Lanes8::store_halves(dst, halves);
    m.stored(halves, stored);
  } else {
    const __m256i high = kStochastic ? bf16_sr8(u, random) : bf16_rne_high8(u);
    // Words 0-3 and 4-7 land in the low quadword of each 128-bit lane: gather those two.
    const __m256i words = _mm256_packus_epi32(_mm256_srli_epi32(high, 16), _mm256_setzero_si256());
    Lanes8::store_halves(dst, _mm256_castsi256_si128(_mm256_permute4x64_epi64(words, 0x08)));
    m.stored(_mm256_castsi256_ps(high));
  }
}

// accumulate_span's vector loop over the first elements of [0, n) from the flat index lo, a
// multiple of 32: 32 elements per trip (one PairRandom8 draw, a prefetch per 64 bytes of each
// stream), 8 lanes at a time (any dtype pair: load_floats8 widens each exactly), measured as
// Measured8 measures (element 8k + l into lane l of the squares, so their total is
// grad_sumsq_'s of the written buffer bit for bit). Returns the elements done (a multiple of
// 32).
template <class P, class G, bool kFirst, bool kStochastic, Measure kMeasure>
int64_t accumulate_avx2(typename P::T* __restrict b, const typename G::T* __restrict g,
                        int64_t n, uint32_t lo, uint32_t hi, uint32_t key, float inv_scale,
                        double* lanes, uint32_t& largest) {
  const PairRandom8 random(key, hi);
  Measured8<kMeasure> measured(inv_scale, lanes);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    prefetch_trip<P, G, 32>(b + i, g + i);
    __m256i r[4] = {};
    if constexpr (kStochastic) random.bits(lo + static_cast<uint32_t>(i), r);
    __m256 u[4];
    for (int part = 0; part < 4; ++part) {
      const int64_t e = i + 8 * part;
      u[part] = load_floats8<G>(g + e);
      if constexpr (!kFirst) u[part] = _mm256_add_ps(load_floats8<P>(b + e), u[part]);
    }
    if constexpr (std::is_same_v<P, lomo::Fp16> && kStochastic) {
      store_fp16_sr_trip<Lanes8>(b + i, u, r, measured);
    } else {
      for (int part = 0; part < 4; ++part) {
        store_accumulated8<P, kStochastic>(b + i + 8 * part, u[part], r[part], measured);
      }
    }
  }
  measured.finish(lanes, largest);
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

// The squares in sumsq_span's lanes as add_squares16 adds them.
struct Squares16 {
  __m512d acc;
  explicit Squares16(const double* lanes) : acc(_mm512_loadu_pd(lanes)) {}
  LOMO_INLINE void add(__m512 values, __m512 inv) { add_squares16(values, inv, acc); }
  void store(double* lanes) const { _mm512_storeu_pd(lanes, acc); }
};
template <Measure kMeasure>
using Measured16 = Measured<Lanes16, Squares16, kMeasure>;

// 32 fp32 values (u0: elements 0-15, u1: 16-31) stored at dst in P's dtype as
// store_accumulated8 stores them, handed to `m` in order. bf16: one vpermt2w takes the 32
// high words in element order.
template <class P, bool kStochastic, class Measured>
LOMO_INLINE void store_accumulated32(typename P::T* dst, __m512 u0, __m512 u1, __m512i r0,
                                     __m512i r1, Measured& m) {
  if constexpr (std::is_same_v<P, lomo::Fp32>) {
    _mm512_storeu_ps(dst, u0);
    _mm512_storeu_ps(dst + 16, u1);
    m.stored(u0);
    m.stored(u1);
  } else if constexpr (std::is_same_v<P, lomo::Fp16> && kStochastic) {
    const __m512 u[2] = {u0, u1};
    const __m512i random[2] = {r0, r1};
    store_fp16_sr_trip<Lanes16>(dst, u, random, m);
  } else if constexpr (std::is_same_v<P, lomo::Fp16>) {
    __m512 s0, s1;
    const __m256i h0 = fp16_halves<Lanes16, kStochastic>(u0, r0, s0);
    Lanes16::store_halves(dst, h0);
    const __m256i h1 = fp16_halves<Lanes16, kStochastic>(u1, r1, s1);
    Lanes16::store_halves(dst + 16, h1);
    m.stored(h0, s0);
    m.stored(h1, s1);
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
    m.stored(_mm512_castsi512_ps(_mm512_and_si512(w0, high)));
    m.stored(_mm512_castsi512_ps(_mm512_and_si512(w1, high)));
  }
}

// accumulate_avx2 on 16 lanes (lo a multiple of 32): 32 elements per step (one PairRandom16
// draw), measured as Measured16 measures. Returns the elements done (a multiple of 32).
template <class P, class G, bool kFirst, bool kStochastic, Measure kMeasure>
int64_t accumulate_avx512(typename P::T* __restrict b, const typename G::T* __restrict g,
                          int64_t n, uint32_t lo, uint32_t hi, uint32_t key, float inv_scale,
                          double* lanes, uint32_t& largest) {
  const PairRandom16 random(key, hi);
  Measured16<kMeasure> measured(inv_scale, lanes);
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
    store_accumulated32<P, kStochastic>(b + i, u0, u1, r0, r1, measured);
  }
  measured.finish(lanes, largest);
  return i;
}
#endif
