// The loops of the 8-bit blockwise buffer's ops (int8_blocks.h; lomo_kernels/core/
// int8_blocks.py) at one vector level: part of lomo_cpu_loops.h, included at its end (after
// update_block and the sum of squares' lanes; at the vector levels after lomo_cpu_avx2.h and
// lomo_cpu_accumulate.h), so no include guard. Every level gives bit-identical results.
//
// Accumulation takes one block at a time: its new values (in registers at AVX-512, else in an
// fp32 tile that stays in L1), their largest magnitude, the block's scale, the codes and the
// stored values' squares, so the gradient and the codes are read once and the codes written
// once. A block starts at a flat
// index that is a multiple of 256: it never crosses a multiple of 2^32, and its stochastic bits
// are eight of the accumulation stream's blocks of 32 (lomo::pair_bits16), drawn as
// grad_accumulate_'s loops draw them.
// The update and the dequantisation read the values code * scale (exact) into a tile; the
// update then runs the dense update's loops on it (update_block with an fp32 gradient).

using int8_blocks::kBlock;
using int8_blocks::kMagnitudeMask;

// Stochastic rounding adds u = (2 r + 1 - 2^16) / 2^17 for 16 random bits r, an offset
// uniform on (-1/2, 1/2), and rounds to nearest even: it leans neither way (the reference's
// int8_stochastic_codes). u = r * 2^-16 + (2^-17 - 1/2): the product and the sum are exact,
// fused or not.
constexpr float kRandomUnit = 1.0f / 65536.0f;
constexpr float kCentre = 1.0f / 131072.0f - 0.5f;

// The lines of [ptr, ptr + bytes), kPrefetchBytes ahead, with the non-temporal hint of the
// accumulation's loops (prefetch_streams).
LOMO_INLINE void prefetch_nta_ahead(const void* ptr, int64_t bytes) {
#if defined(__GNUC__) || defined(__clang__)
  const char* ahead = static_cast<const char*>(ptr) + kPrefetchBytes;
  for (int64_t k = 0; k < bytes; k += kLineBytes) __builtin_prefetch(ahead + k, 0, 0);
#else
  (void)ptr;
  (void)bytes;
#endif
}

// ---------------------------------------------------------------------------------------
// Portable forms (the baseline level; partial blocks at every level)

// round(x), half to even, for |x| < 2^22: adding and removing 1.5 * 2^23 rounds x to an
// integer by the fp32 addition itself (vectorises without SSE4.1's ROUNDPS; -0.4 gives +0,
// the same code).
LOMO_INLINE float round_code(float x) {
  constexpr float kShift = 12582912.0f;  // 1.5 * 2^23
  return lomo::sub_rn(lomo::add_rn(x, kShift), kShift);
}

// The code of x = value / scale as an fp32 integer: to nearest even, or x + (2 random16 + 1 -
// 2^16) / 2^17 to nearest even with the sum rounded to fp32, as the reference forms it. No
// clamp to +-127 is needed (the reference's changes nothing): the scale makes |x| <= 127
// exactly, and |x + u| is at most 127.5 - 2^-17, on fp32's grid of 2^-17 there.
template <bool kStochastic>
LOMO_INLINE float code_of(float x, uint32_t random16) {
  if constexpr (kStochastic) {
    const float r = static_cast<float>(static_cast<int32_t>(random16));
    return round_code(lomo::add_rn(x, lomo::add_rn(lomo::mul_rn(r, kRandomUnit), kCentre)));
  } else {
    return round_code(x);
  }
}

// A block's new values into tile[head, head + count): fp32(grad) (kFirst: the codes are not
// read) or code * scale + fp32(grad) (the product is exact); a partial block's other positions
// 0, which change no largest magnitude or code (nor are they measured: add_partial_squares).
// Returns the bits of the largest magnitude (int8_blocks::kNonFiniteBits or more: the block
// holds an inf or nan).
template <class G, bool kFirst>
uint32_t fill_block_portable(float* __restrict tile, const int8_t* __restrict codes, float scale,
                             const typename G::T* __restrict g, int64_t head, int64_t count) {
  if (count != kBlock) std::fill(tile, tile + kBlock, 0.0f);
  float* __restrict out = tile + head;
  uint32_t max_bits = 0;
  for (int64_t k = 0; k < count; ++k) {
    const float gv = G::load(g[k]);
    const float v =
        kFirst ? gv : lomo::add_rn(lomo::mul_rn(static_cast<float>(codes[k]), scale), gv);
    out[k] = v;
    max_bits = std::max(max_bits, lomo::bits_of(v) & kMagnitudeMask);
  }
  return max_bits;
}

// The sum of squares' lanes: position k of a block into lane k % kInt8Lanes, in order, so
// every level adds the same sums; 32 lanes are four vectors of doubles at AVX-512 and eight at
// AVX2, independent chains of additions.
constexpr int kInt8Lanes = 32;

// The codes of a finite block's kBlock tile values into out, rounded with the bits of the flat
// indices (hi << 32 | lo + k) when kStochastic; with kMeasure the squares of the stored values
// code * scale, times inv and widened to double, added into lanes (kInt8Lanes of them).
template <bool kStochastic, bool kMeasure>
void quantize_block_portable(const float* __restrict tile, int8_t* __restrict out,
                             int8_blocks::Scale scale, uint32_t lo, uint32_t hi, uint32_t key,
                             float inv, double* lanes) {
  static_assert(kInt8Lanes == 32, "a lane per position of a block of 32");
  double acc[kInt8Lanes];  // local: the int8 stores may alias `lanes`, not these
  std::copy(lanes, lanes + kInt8Lanes, acc);
  for (int64_t t = 0; t < kBlock; t += 32) {
    uint32_t random[32] = {};
    if constexpr (kStochastic) pair_bits32(lo + static_cast<uint32_t>(t), hi, key, random);
    float q[32];
    for (int k = 0; k < 32; ++k) {
      q[k] = code_of<kStochastic>(lomo::mul_rn(tile[t + k], scale.inverse), random[k]);
    }
    for (int k = 0; k < 32; ++k) out[t + k] = static_cast<int8_t>(static_cast<int32_t>(q[k]));
    if constexpr (kMeasure) {
      for (int k = 0; k < 32; ++k) {
        const double v = lomo::mul_rn(lomo::mul_rn(q[k], scale.scale), inv);
        acc[k] += v * v;
      }
    }
  }
  std::copy(acc, acc + kInt8Lanes, lanes);
}

// ---------------------------------------------------------------------------------------
// Vector forms of whole blocks

#if LOMO_LOOPS_AVX2
// fill_block_portable of a whole block, 8 lanes; the largest magnitude as the largest of the
// magnitudes' bits (unsigned: inf and nan above every finite value).
template <class G, bool kFirst>
uint32_t fill_block_avx2(float* __restrict tile, const int8_t* __restrict codes, float scale,
                         const typename G::T* __restrict g) {
  const __m256 scale_v = _mm256_set1_ps(scale);
  const __m256i magnitude = _mm256_set1_epi32(static_cast<int>(kMagnitudeMask));
  __m256i max_bits = _mm256_setzero_si256();
  for (int64_t k = 0; k < kBlock; k += 8) {
    __m256 v = load_floats8<G>(g + k);
    if constexpr (!kFirst) {
      const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + k));
      v = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight)), scale_v), v);
    }
    _mm256_store_ps(tile + k, v);
    max_bits = _mm256_max_epu32(max_bits, _mm256_and_si256(_mm256_castps_si256(v), magnitude));
  }
  __m128i m = _mm_max_epu32(_mm256_castsi256_si128(max_bits),
                            _mm256_extracti128_si256(max_bits, 1));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0x4E));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0xB1));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(m));
}

// quantize_block_portable on 8 lanes: ROUNDPS to nearest even or down, one PairRandom8 draw
// per 32 elements, the squares of vector k of a trip in add_squares8's two vectors 2k, 2k + 1
// (lanes 8k .. 8k + 7).
template <bool kStochastic, bool kMeasure>
void quantize_block_avx2(const float* __restrict tile, int8_t* __restrict out,
                         int8_blocks::Scale scale, uint32_t lo, uint32_t hi, uint32_t key,
                         float inv_scale, double* lanes) {
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const PairRandom8 random(key, hi);
  const __m256 inverse = _mm256_set1_ps(scale.inverse), scale_v = _mm256_set1_ps(scale.scale);
  const __m256 inv = _mm256_set1_ps(inv_scale), unit = _mm256_set1_ps(kRandomUnit);
  const __m256 centre = _mm256_set1_ps(kCentre);
  // The two packs leave dword d of each 128-bit lane holding codes of vector d: this puts
  // the dwords back in element order.
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  __m256d acc[kInt8Lanes / 4];
  for (int k = 0; k < kInt8Lanes / 4; ++k) acc[k] = _mm256_loadu_pd(lanes + 4 * k);
  for (int64_t t = 0; t < kBlock; t += 32) {
    __m256i r[4] = {};
    if constexpr (kStochastic) random.bits(lo + static_cast<uint32_t>(t), r);
    __m256i q[4];
    for (int part = 0; part < 4; ++part) {
      __m256 x = _mm256_mul_ps(_mm256_load_ps(tile + t + 8 * part), inverse);
      if constexpr (kStochastic) {
        const __m256 u = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(r[part]), unit), centre);
        x = _mm256_add_ps(x, u);
      }
      const __m256 c = _mm256_round_ps(x, kNearest);
      q[part] = _mm256_cvttps_epi32(c);
      if constexpr (kMeasure) {
        add_squares8(_mm256_mul_ps(c, scale_v), inv, acc[2 * part], acc[2 * part + 1]);
      }
    }
    const __m256i bytes =
        _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + t),
                        _mm256_permutevar8x32_epi32(bytes, order));
  }
  for (int k = 0; k < kInt8Lanes / 4; ++k) _mm256_storeu_pd(lanes + 4 * k, acc[k]);
}
#endif

#if LOMO_LOOPS_AVX512
// Vectors of 16 in a block (its values stay in registers).
constexpr int kBlockVectors = kBlock / 16;

// fill_block_avx2 of a whole block on 16 lanes, into v.
template <class G, bool kFirst>
LOMO_INLINE uint32_t fill_vectors_avx512(__m512 (&v)[kBlockVectors],
                                         const int8_t* __restrict codes, float scale,
                                         const typename G::T* __restrict g) {
  const __m512 scale_v = _mm512_set1_ps(scale);
  const __m512i magnitude = _mm512_set1_epi32(static_cast<int>(kMagnitudeMask));
  __m512i max_bits = _mm512_setzero_si512();
#pragma GCC unroll 16
  for (int k = 0; k < kBlockVectors; ++k) {
    v[k] = load_floats16<G>(g + 16 * k);
    if constexpr (!kFirst) {
      const __m128i sixteen = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * k));
      const __m512 code = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sixteen));
      v[k] = _mm512_add_ps(_mm512_mul_ps(code, scale_v), v[k]);
    }
    max_bits = _mm512_max_epu32(max_bits, _mm512_and_si512(_mm512_castps_si512(v[k]), magnitude));
  }
  return _mm512_reduce_max_epu32(max_bits);
}

// quantize_block_avx2 on 16 lanes, the block's vector k of 16 values from value(k) (registers
// or the tile): VCVTPS2DQ with the rounding in the instruction, two PairRandom16 draws per 64
// elements, two packs and a VPERMD to their codes; the squares of positions 8k .. 8k + 7 (mod
// 32) in vector k of doubles.
template <bool kStochastic, bool kMeasure, class Values>
LOMO_INLINE void quantize_vectors_avx512(Values value, int8_t* __restrict out,
                                         int8_blocks::Scale scale, uint32_t lo, uint32_t hi,
                                         uint32_t key, float inv_scale, double* lanes) {
  const PairRandom16 random(key, hi);
  const __m512 inverse = _mm512_set1_ps(scale.inverse), scale_v = _mm512_set1_ps(scale.scale);
  const __m512 inv = _mm512_set1_ps(inv_scale), unit = _mm512_set1_ps(kRandomUnit);
  const __m512 centre = _mm512_set1_ps(kCentre);
  // The packs leave dword d of each 128-bit lane holding codes of vector d: back in order.
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  __m512d acc[kInt8Lanes / 8];
  if constexpr (kMeasure) {
    for (int k = 0; k < kInt8Lanes / 8; ++k) acc[k] = _mm512_loadu_pd(lanes + 8 * k);
  }
#pragma GCC unroll 4
  for (int t = 0; t < kBlockVectors; t += 4) {
    __m512i r[4] = {};
    if constexpr (kStochastic) {
      random.bits(lo + static_cast<uint32_t>(16 * t), r[0], r[1]);
      random.bits(lo + static_cast<uint32_t>(16 * t + 32), r[2], r[3]);
    }
    __m512i q[4];
#pragma GCC unroll 4
    for (int h = 0; h < 4; ++h) {
      __m512 x = _mm512_mul_ps(value(t + h), inverse);
      if constexpr (kStochastic) {
        x = _mm512_add_ps(x, _mm512_fmadd_ps(_mm512_cvtepi32_ps(r[h]), unit, centre));
      }
      q[h] = _mm512_cvt_roundps_epi32(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      if constexpr (kMeasure) {
        const __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(q[h]), scale_v), inv);
        const __m512d a = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
        const __m512d b = _mm512_cvtps_pd(_mm512_extractf32x8_ps(v, 1));
        const int lane = 2 * (h % 2);  // positions 16h .. 16h + 15 of 64: lanes 16 (h % 2) on
        acc[lane] = _mm512_add_pd(acc[lane], _mm512_mul_pd(a, a));
        acc[lane + 1] = _mm512_add_pd(acc[lane + 1], _mm512_mul_pd(b, b));
      }
    }
    // |code| <= 127: the saturating packs keep every code.
    const __m512i bytes =
        _mm512_packs_epi16(_mm512_packs_epi32(q[0], q[1]), _mm512_packs_epi32(q[2], q[3]));
    _mm512_storeu_si512(out + 16 * t, _mm512_permutexvar_epi32(order, bytes));
  }
  if constexpr (kMeasure) {
    for (int k = 0; k < kInt8Lanes / 8; ++k) _mm512_storeu_pd(lanes + 8 * k, acc[k]);
  }
}
#endif

// ---------------------------------------------------------------------------------------
// The level's forms

// A block's new values into the tile: whole blocks by the AVX2 loop at the AVX2 level, the
// others by the portable loop (the AVX-512 level keeps whole blocks in registers instead).
template <class G, bool kFirst>
LOMO_INLINE uint32_t fill_block(float* tile, const int8_t* codes, float scale,
                                const typename G::T* g, int64_t head, int64_t count) {
#if LOMO_LOOPS_AVX2 && !LOMO_LOOPS_AVX512
  if (count == kBlock) return fill_block_avx2<G, kFirst>(tile, codes, scale, g);
#endif
  return fill_block_portable<G, kFirst>(tile, codes, scale, g, head, count);
}

template <bool kStochastic, bool kMeasure>
LOMO_INLINE void quantize_block(const float* tile, int8_t* out, int8_blocks::Scale scale,
                                uint32_t lo, uint32_t hi, uint32_t key, float inv,
                                double* lanes) {
#if LOMO_LOOPS_AVX512
  quantize_vectors_avx512<kStochastic, kMeasure>(
      [&](int k) { return _mm512_load_ps(tile + 16 * k); }, out, scale, lo, hi, key, inv, lanes);
#elif LOMO_LOOPS_AVX2
  quantize_block_avx2<kStochastic, kMeasure>(tile, out, scale, lo, hi, key, inv, lanes);
#else
  quantize_block_portable<kStochastic, kMeasure>(tile, out, scale, lo, hi, key, inv, lanes);
#endif
}

// A block holding an inf or nan (the largest magnitude's bits kNonFiniteBits or more) stores
// codes 0 and a nan scale, and makes the sum of squares nan; returns whether it was one.
template <bool kMeasure>
LOMO_INLINE bool store_nonfinite_block(uint32_t max_bits, int8_t* codes, int64_t count,
                                       float& scale_slot, double* lanes) {
  if (max_bits < int8_blocks::kNonFiniteBits) return false;
  std::memset(codes, 0, static_cast<size_t>(count));
  scale_slot = lomo::float_of(int8_blocks::kNanScaleBits);
  if constexpr (kMeasure) lanes[0] += std::numeric_limits<double>::quiet_NaN();
  return true;
}

// A partial block's squares, its positions alone (its padding times an inf inv would be nan)
// into the lanes the whole tile's would use, in the same order: position k of the block into
// lane k % kInt8Lanes.
LOMO_INLINE void add_partial_squares(const int8_t* codes, const int8_blocks::BlockSpan& span,
                                     float scale, float inv, double* lanes) {
  for (int64_t k = span.head; k < span.head + span.count; ++k) {
    const double v = lomo::mul_rn(lomo::mul_rn(static_cast<float>(codes[k]), scale), inv);
    lanes[k % kInt8Lanes] += v * v;
  }
}

// One block of accumulate_int8_span: codes c and gradient g from the buffer's first element in
// it, its scale in scale_slot (read unless kFirst, then written).
template <class G, bool kFirst, bool kStochastic, bool kMeasure>
LOMO_INLINE void accumulate_block(const int8_blocks::BlockSpan& span, int8_t* c,
                                  const typename G::T* g, float& scale_slot, uint32_t key,
                                  float inv, double* lanes) {
  const uint32_t lo = static_cast<uint32_t>(span.flat);
  const uint32_t hi = static_cast<uint32_t>(span.flat >> 32);
  const float old_scale = kFirst ? 0.0f : scale_slot;
#if LOMO_LOOPS_AVX512
  if (span.whole()) {
    __m512 v[kBlockVectors];
    const uint32_t max_bits = fill_vectors_avx512<G, kFirst>(v, c, old_scale, g);
    if (store_nonfinite_block<kMeasure>(max_bits, c, span.count, scale_slot, lanes)) return;
    const int8_blocks::Scale scale = int8_blocks::power_of_two(max_bits);
    quantize_vectors_avx512<kStochastic, kMeasure>([&](int k) { return v[k]; }, c, scale, lo, hi,
                                                   key, inv, lanes);
    scale_slot = scale.scale;
    return;
  }
#endif
  alignas(64) float tile[kBlock];
  alignas(64) int8_t partial[kBlock];  // a partial block's codes, before they are copied out
  const uint32_t max_bits = fill_block<G, kFirst>(tile, c, old_scale, g, span.head, span.count);
  if (store_nonfinite_block<kMeasure>(max_bits, c, span.count, scale_slot, lanes)) return;
  const int8_blocks::Scale scale = int8_blocks::power_of_two(max_bits);
  if (span.whole()) {
    quantize_block<kStochastic, kMeasure>(tile, c, scale, lo, hi, key, inv, lanes);
  } else {
    quantize_block<kStochastic, false>(tile, partial, scale, lo, hi, key, inv, lanes);
    std::memcpy(c, partial + span.head, static_cast<size_t>(span.count));
    if constexpr (kMeasure) add_partial_squares(partial, span, scale.scale, inv, lanes);
  }
  scale_slot = scale.scale;
}

// ---------------------------------------------------------------------------------------
// The ops' spans

// Whether blocks [first_block, first_block + blocks) as stored hold a value whose product with
// inv is inf/nan: a nan scale (a block that held an inf or nan), or else a code * scale * inv
// past fp32, which needs a look at the codes only where 127 times the largest scale times inv
// is (fp32 rounding is monotone and |code| <= 127): the squares' flag without the squares.
inline uint32_t int8_flag(const int8_t* codes, const float* scales, int64_t offset,
                          int64_t numel, int64_t first_block, int64_t blocks, float inv) {
  float largest = 0.0f;
  for (int64_t b = first_block; b < first_block + blocks; ++b) {
    if (std::isnan(scales[b])) return 1u;
    largest = std::max(largest, scales[b]);
  }
  if (std::isfinite(lomo::mul_rn(lomo::mul_rn(127.0f, largest), inv))) return 0u;
  for (int64_t b = first_block; b < first_block + blocks; ++b) {
    const int8_blocks::BlockSpan span = int8_blocks::block_span(offset, numel, b);
    for (int64_t k = 0; k < span.count; ++k) {
      const float code = static_cast<float>(codes[span.begin + k]);
      if (!std::isfinite(lomo::mul_rn(lomo::mul_rn(code, scales[b]), inv))) return 1u;
    }
  }
  return 0u;
}

// Blocks [first_block, first_block + blocks) of grad_accumulate_int8_ on a buffer of `numel`
// elements at flat `offset` (codes, grad: from the buffer's element 0; scales: one per block).
// Each block: new = fp32(grad) (kFirst: codes and scales not read) or code * scale +
// fp32(grad); its scale from the largest |new|; the codes to nearest even or stochastically
// (kStochastic: pair_bits16 of each element's flat index under `key`); a block holding an inf
// or nan stores codes 0 and a nan scale. kSquares returns the stored values' (times inv) sum
// of squares, its kInt8Lanes lanes added in order, and sets bad when it is not finite (a nan
// block, or a stored value times inv past fp32); kFlag sets only that flag (int8_flag); both
// others return 0.
template <class G, bool kFirst, bool kStochastic, Measure kMeasure>
double accumulate_int8_span(int8_t* codes, float* scales, const typename G::T* grad,
                            int64_t offset, int64_t numel, int64_t first_block, int64_t blocks,
                            float inv, uint32_t key, uint32_t& bad) {
  constexpr bool kSquares = kMeasure == Measure::kSquares;
  double lanes[kInt8Lanes] = {};
  for (int64_t b = first_block; b < first_block + blocks; ++b) {
    const int8_blocks::BlockSpan span = int8_blocks::block_span(offset, numel, b);
    int8_t* c = codes + span.begin;
    const typename G::T* g = grad + span.begin;
    prefetch_nta_ahead(g, span.count * static_cast<int64_t>(sizeof(typename G::T)));
    prefetch_nta_ahead(c, span.count);
    accumulate_block<G, kFirst, kStochastic, kSquares>(span, c, g, scales[b], key, inv, lanes);
  }
  if constexpr (kMeasure == Measure::kFlag) {
    bad |= int8_flag(codes, scales, offset, numel, first_block, blocks, inv);
  }
  if constexpr (!kSquares) return 0.0;
  double total = 0.0;
  for (double lane : lanes) total += lane;
  bad |= std::isfinite(total) ? 0u : 1u;  // no finite sum overflows: as lanes_total
  return total;
}

// The values code * scale of the buffer's elements [begin, begin + count) into out (exact: the
// scales are powers of two; a nan scale gives nan); lead = offset % kBlock.
inline void int8_values(const int8_t* __restrict codes, const float* __restrict scales,
                        int64_t lead, int64_t begin, int64_t count, float* __restrict out) {
  const int64_t end = begin + count;
  for (int64_t j = begin; j < end;) {
    const int64_t b = (lead + j) / kBlock;
    const int64_t stop = std::min(end, (b + 1) * kBlock - lead);
    const float scale = scales[b];
    for (int64_t k = j; k < stop; ++k) {
      out[k - begin] = lomo::mul_rn(static_cast<float>(codes[k]), scale);
    }
    j = stop;
  }
}

// Elements per tile of the update's gradient values: 8 blocks, 8 KiB of fp32 (L1).
constexpr int64_t kInt8UpdateTile = 8 * kBlock;

// lomo_update_int8_ of the param (slice) elements [begin, end) at flat `offset`: per tile, the
// gradient code * scale, then the dense update's loop (update_block) with the write-back's bits
// at each element's flat index. A tile ends at a multiple of kInt8UpdateTile of the flat
// index, so none crosses a multiple of 2^32. Returns non-zero if any g * inv_scale was inf/nan.
template <class P, bool kStochastic>
uint32_t update_int8_span(typename P::T* param, const int8_t* codes, const float* scales,
                          int64_t offset, int64_t begin, int64_t end, const lomo::LomoScalars& s,
                          uint32_t key) {
  alignas(64) float values[kInt8UpdateTile];
  const int64_t lead = offset % kBlock;
  uint32_t any_bad = 0;
  while (begin < end) {
    const uint64_t flat = static_cast<uint64_t>(offset + begin);
    const int64_t room = kInt8UpdateTile - static_cast<int64_t>(flat % kInt8UpdateTile);
    const int64_t count = std::min(end - begin, room);
    int8_values(codes, scales, lead, begin, count, values);
    any_bad |= update_block<P, lomo::Fp32, kStochastic>(param + begin, values, count,
                                                        static_cast<uint32_t>(flat),
                                                        static_cast<uint32_t>(flat >> 32), s, key);
    begin += count;
  }
  return any_bad;
}

// int8_dequantize_ of the elements [begin, end): out = code * scale in P (exact for fp32 and
// bf16, fp16 to nearest even).
template <class P>
void dequantize_int8_span(typename P::T* __restrict out, const int8_t* __restrict codes,
                          const float* __restrict scales, int64_t offset, int64_t begin,
                          int64_t end) {
  const int64_t lead = offset % kBlock;
  for (int64_t j = begin; j < end;) {
    const int64_t b = (lead + j) / kBlock;
    const int64_t stop = std::min(end, (b + 1) * kBlock - lead);
    const float scale = scales[b];
    for (int64_t k = j; k < stop; ++k) {
      out[k] = P::round(lomo::mul_rn(static_cast<float>(codes[k]), scale));
    }
    j = stop;
  }
}
