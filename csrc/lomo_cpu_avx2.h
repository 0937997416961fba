// AVX2 (+F16C) loops of the LOMO update for same-dtype parameter/gradient pairs: part of
// lomo_cpu_loops.h, compiled for the AVX2 and AVX-512 levels only (see there).
//
// Each loop is lomo::lomo_element_exp on 8 lanes with the same rounded operations in the same
// order (so results are bit-identical to the portable loops), at 64 bytes of each stream per
// trip with one software prefetch per stream and line (prefetch_streams, lomo_cpu_lanes.h).
// Measured on an AVX2-only AMD EPYC with one thread: the compiler's own vectorisation of the
// portable loops (no prefetch, one vector per trip) stays at 1.2-1.5x the time of an in-place
// axpy moving the same bytes; without the prefetches these loops do too (the hardware
// prefetchers alone keep too few lines in flight for a loop body this long).

// The update's scalars broadcast to 8 lanes.
struct Avx2Scalars {
  __m256 inv_scale, neg_clip, clip, coef, lr, decay;
  __m256i exponent;  // kNonFiniteExponent
  explicit Avx2Scalars(const lomo::LomoScalars& s)
      : inv_scale(_mm256_set1_ps(s.inv_scale)),
        neg_clip(_mm256_set1_ps(-s.clip)),
        clip(_mm256_set1_ps(s.clip)),
        coef(_mm256_set1_ps(s.coef)),
        lr(_mm256_set1_ps(s.lr)),
        decay(_mm256_set1_ps(s.decay)),
        exponent(_mm256_set1_epi32(static_cast<int>(lomo::kNonFiniteExponent))) {}
};

// lomo_element_exp on 8 lanes; bad: all-ones lanes where the unscaled gradient is inf/nan.
LOMO_INLINE __m256 lomo_vector8(__m256 g, __m256 p, const Avx2Scalars& v, __m256i& bad) {
  g = _mm256_mul_ps(g, v.inv_scale);
  bad = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(g), v.exponent), v.exponent);
  // MAX(a, b) is a > b ? a : b and MIN(a, b) is a < b ? a : b, so with the bound first these
  // are the reference's selects g < -clip ? -clip : g and g > clip ? clip : g, for any bound,
  // ties and nans included.
  g = _mm256_max_ps(v.neg_clip, g);
  g = _mm256_min_ps(v.clip, g);
  g = _mm256_mul_ps(g, v.coef);
  return _mm256_sub_ps(_mm256_mul_ps(p, v.decay), _mm256_mul_ps(v.lr, g));
}

LOMO_INLINE __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

LOMO_INLINE __m256i load_words(const uint16_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

LOMO_INLINE void store_words(uint16_t* p, __m256i v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v);
}

// fp32: 16 elements (64 bytes of each stream) per trip. A trip with an inf/nan gradient lane
// (rare: the step is then skipped anyway) stores old values there; the others store the
// updates unblended, which saves a blend per vector in the common case.
inline uint32_t update_fp32_avx2(float* __restrict p, const float* __restrict g, int64_t n,
                                 const lomo::LomoScalars& s) {
  const Avx2Scalars v(s);
  uint32_t any_bad = 0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    prefetch_streams(p + i, g + i);
    const __m256 old0 = load8(p + i), old1 = load8(p + i + 8);
    __m256i bad0, bad1;
    __m256 u0 = lomo_vector8(load8(g + i), old0, v, bad0);
    __m256 u1 = lomo_vector8(load8(g + i + 8), old1, v, bad1);
    if (__builtin_expect(Lanes8::any(_mm256_or_si256(bad0, bad1)), 0)) {
      u0 = _mm256_blendv_ps(u0, old0, _mm256_castsi256_ps(bad0));
      u1 = _mm256_blendv_ps(u1, old1, _mm256_castsi256_ps(bad1));
      any_bad = 1;
    }
    _mm256_storeu_ps(p + i, u0);
    _mm256_storeu_ps(p + i + 8, u1);
  }
  return any_bad |
         update_elements<lomo::Fp32, lomo::Fp32, false>(p + i, g + i, n - i, 0, 0, s, 0);
}

// bf16_rne_high on 8 lanes: the rounded bf16 bits in the high half, low half zero.
LOMO_INLINE __m256i bf16_rne_high8(__m256 u) {
  const __m256i b = _mm256_castps_si256(u);
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_and_si256(
      _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), lsb), high);
  const __m256i quiet_nan =
      _mm256_and_si256(_mm256_or_si256(b, _mm256_set1_epi32(0x00400000)), high);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(u, u, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, quiet_nan, nan);
}

// lomo::f32_to_bf16_sr on 8 lanes, the result in the high half. index: the low 32 bits of
// each lane's flat element index; key, hi: as random_bits16 takes them.
LOMO_INLINE __m256i bf16_sr_high8(__m256 u, __m256i index, __m256i key, __m256i hi) {
  const __m256i random = _mm256_srli_epi32(random_product<Lanes8>(index, key, hi), 16);
  const __m256i b = _mm256_castps_si256(u);
  const __m256i mag = _mm256_and_si256(b, _mm256_set1_epi32(0x7FFFFFFF));
  // mag >= 0x7F800000 (inf/nan: not perturbed); mag < 2^31, so a signed compare is exact.
  const __m256i nonfinite = _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x7F7FFFFF));
  const __m256i sum = _mm256_add_epi32(b, _mm256_andnot_si256(nonfinite, random));
  const __m256i out = _mm256_and_si256(sum, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(u, u, _CMP_UNORD_Q));
  return _mm256_or_si256(out, _mm256_and_si256(nan, _mm256_set1_epi32(0x00400000)));
}

// random_bits16 of 8 consecutive flat indices (the same high half), in 32-bit lanes.
struct Avx2Random {
  __m256i key, hi, offset;
  Avx2Random(uint32_t key_value, uint32_t hi_value)
      : key(_mm256_set1_epi32(static_cast<int>(key_value))),
        hi(_mm256_set1_epi32(static_cast<int>(hi_value))),
        offset(Lanes8::iota()) {}
  // Lanes first .. first + 7 (update_span keeps a block inside one 2^32 range: no wrap).
  LOMO_INLINE __m256i bits(uint32_t first) const {
    const __m256i index = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(first)), offset);
    return _mm256_srli_epi32(random_product<Lanes8>(index, key, hi), 16);
  }
};

// bf16 parameter and gradient, 32 elements per trip in two halves of 16. Each 32-bit word
// holds elements 2k (low half) and 2k + 1 (high half), split and reassembled in place as in
// update_bf16_pairs, so no lane crosses. A trip with an inf/nan gradient lane (rare) takes
// update_bf16_pairs, which keeps the old bits there; the vector path never blends.
template <bool kStochastic>
uint32_t update_bf16_avx2(uint16_t* __restrict p, const uint16_t* __restrict g, int64_t n,
                          uint32_t lo, uint32_t hi, const lomo::LomoScalars& s, uint32_t key) {
  const Avx2Scalars v(s);
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  // Offsets of the even elements of 16 (0, 2, ..., 14) from the first one.
  const __m256i even_offset = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i key_v = _mm256_set1_epi32(static_cast<int>(key));
  const __m256i hi_v = _mm256_set1_epi32(static_cast<int>(hi));
  uint32_t any_bad = 0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    prefetch_streams(p + i, g + i);
    __m256 u_even[2], u_odd[2];
    __m256i trip_bad = _mm256_setzero_si256();
    for (int half = 0; half < 2; ++half) {
      const __m256i pw = load_words(p + i + 16 * half);
      const __m256i gw = load_words(g + i + 16 * half);
      __m256i bad_even, bad_odd;
      u_even[half] = lomo_vector8(_mm256_castsi256_ps(_mm256_slli_epi32(gw, 16)),
                                  _mm256_castsi256_ps(_mm256_slli_epi32(pw, 16)), v, bad_even);
      u_odd[half] = lomo_vector8(_mm256_castsi256_ps(_mm256_and_si256(gw, high)),
                                 _mm256_castsi256_ps(_mm256_and_si256(pw, high)), v, bad_odd);
      trip_bad = _mm256_or_si256(trip_bad, _mm256_or_si256(bad_even, bad_odd));
    }
    if (__builtin_expect(Lanes8::any(trip_bad), 0)) {
      any_bad |= update_bf16_pairs<lomo::Bf16, kStochastic>(
          p + i, g + i, 32, lo + static_cast<uint32_t>(i), hi, s, key);
      continue;
    }
    for (int half = 0; half < 2; ++half) {
      __m256i r_even, r_odd;
      if constexpr (kStochastic) {
        // No wrap: update_span keeps a block inside one 2^32 range of indices.
        const __m256i first =
            _mm256_set1_epi32(static_cast<int>(lo + static_cast<uint32_t>(i + 16 * half)));
        const __m256i index_even = _mm256_add_epi32(first, even_offset);
        r_even = bf16_sr_high8(u_even[half], index_even, key_v, hi_v);
        r_odd = bf16_sr_high8(u_odd[half], _mm256_add_epi32(index_even, one), key_v, hi_v);
      } else {
        r_even = bf16_rne_high8(u_even[half]);
        r_odd = bf16_rne_high8(u_odd[half]);
      }
      store_words(p + i + 16 * half, _mm256_or_si256(r_odd, _mm256_srli_epi32(r_even, 16)));
    }
  }
  return any_bad |
         update_bf16_pairs<lomo::Bf16, kStochastic>(p + i, g + i, n - i,
                                                    lo + static_cast<uint32_t>(i), hi, s, key);
}

// fp16 parameter and gradient, 32 elements per trip: F16C widens 8 halves to fp32 and
// rounds 8 back to nearest even, exact IEEE conversions like lomo::fp16_to_f32 and
// f32_to_fp16. A trip with an inf/nan gradient lane (rare) takes the element loop, which
// keeps the old halves there; the vector path never blends.
inline uint32_t update_fp16_avx2(uint16_t* __restrict p, const uint16_t* __restrict g,
                                 int64_t n, const lomo::LomoScalars& s) {
  const Avx2Scalars v(s);
  uint32_t any_bad = 0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    prefetch_streams(p + i, g + i);
    __m256 u[4];
    __m256i trip_bad = _mm256_setzero_si256();
    for (int part = 0; part < 4; ++part) {
      const __m256 old = Lanes8::widen(Lanes8::load_halves(p + i + 8 * part));
      __m256i bad;
      u[part] = lomo_vector8(Lanes8::widen(Lanes8::load_halves(g + i + 8 * part)), old, v, bad);
      trip_bad = _mm256_or_si256(trip_bad, bad);
    }
    if (__builtin_expect(Lanes8::any(trip_bad), 0)) {
      any_bad |= update_elements<lomo::Fp16, lomo::Fp16, false>(p + i, g + i, 32, 0, 0, s, 0);
      continue;
    }
    for (int part = 0; part < 4; ++part) {
      Lanes8::store_halves(p + i + 8 * part,
                           Lanes8::narrow<_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC>(u[part]));
    }
  }
  return any_bad |
         update_elements<lomo::Fp16, lomo::Fp16, false>(p + i, g + i, n - i, 0, 0, s, 0);
}

// update_fp16_sr on 8 lanes, the update as in update_fp16_avx2.
inline uint32_t update_fp16_sr_avx2(uint16_t* __restrict p, const uint16_t* __restrict g,
                                    int64_t n, uint32_t lo, uint32_t hi,
                                    const lomo::LomoScalars& s, uint32_t key) {
  const Avx2Scalars v(s);
  return update_fp16_sr<Lanes8>(
      p, g, n, lo, hi, s, key,
      [&](__m256 gv, __m256 pv, __m256i& bad) { return lomo_vector8(gv, pv, v, bad); });
}

// ----------------------------------------------------------------------------------------
// Gradient sum of squares

// Eight elements, in order, as fp32: the gradient's own dtype widened exactly.
template <class G>
LOMO_INLINE __m256 load_floats8(const typename G::T* g) {
  if constexpr (std::is_same_v<G, lomo::Fp32>) {
    return _mm256_loadu_ps(g);
  } else {
    const __m128i h = Lanes8::load_halves(g);
    if constexpr (std::is_same_v<G, lomo::Fp16>) {
      return Lanes8::widen(h);
    } else {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
  }
}

// sumsq_span's lanes over the first n - n % 8 elements: lanes 0-3 and 4-7 are two vectors
// of doubles, element i + l goes to lane l as there, and each square is exact in double
// (24-bit significands), so every lane's sum is the portable loop's bit for bit. Adds into
// `lanes`; returns the number of elements consumed. Two dependent adds per 8 elements keep
// this at about memory speed; more accumulators would change the summation order.
// The squares of 8 consecutive values times inv in double, added into sumsq_span's lanes
// 0-3 (low) and 4-7 (high): the fp32 product, then an exact square and one double add each.
LOMO_INLINE void add_squares8(__m256 values, __m256 inv, __m256d& low, __m256d& high) {
  const __m256 v = _mm256_mul_ps(values, inv);
  const __m256d a = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
  const __m256d b = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
  low = _mm256_add_pd(low, _mm256_mul_pd(a, a));
  high = _mm256_add_pd(high, _mm256_mul_pd(b, b));
}

template <class G>
int64_t sumsq_lanes_avx2(const typename G::T* __restrict g, int64_t n, float inv_scale,
                         double* lanes) {
  const __m256 inv = _mm256_set1_ps(inv_scale);
  __m256d low = _mm256_loadu_pd(lanes), high = _mm256_loadu_pd(lanes + 4);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) add_squares8(load_floats8<G>(g + i), inv, low, high);
  _mm256_storeu_pd(lanes, low);
  _mm256_storeu_pd(lanes + 4, high);
  return i;
}
