// The CPU loops of the AdaLomo passes, at one vector level: adalomo_cpu.cpp includes this
// file once per level through cpu_levels.h (each copy in its own namespace and GCC target),
// so no include guard; everything it needs is included or defined before (torch,
// adalomo_math.h, kLanes, Partial). Plain loops with fixed lanes for every sum: the compiler
// vectorises them per level without reassociating any sum, so every level gives the same bits.

// One element of pass A into its row, column, h^2 and p^2 accumulators. h is squared in
// double, as grad_sumsq_ measures it; g = clamp(h) in fp32, as the reference.
template <class P, class G>
void stats_element(const typename G::T& grad, const typename P::T& param,
                   const adalomo::GradScalars& s, double& row, double& col, double& g_acc,
                   double& p_acc, uint32_t& any_bad) {
  uint32_t b;
  const float h = adalomo::scaled_grad(G::load(grad), s, b);
  const float g = adalomo::clamp_grad(h, s);
  const double k = static_cast<double>(lomo::mul_rn(g, g));
  row += k;
  col += k;
  g_acc += static_cast<double>(h) * static_cast<double>(h);
  const double p = static_cast<double>(P::load(param));
  p_acc += p * p;
  any_bad |= b;
}

// Pass A over one block: row sums (per row) and column sums (per column) of g^2, and the
// block's sums of h^2 and p^2.
template <class P, class G>
void stats_block(const typename G::T* grad, const typename P::T* param, int64_t cols,
                 int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                 const adalomo::GradScalars& s, double* row_part, double* col_part,
                 Partial& part) {
  double g_acc[kLanes] = {}, p_acc[kLanes] = {};
  uint32_t any_bad = 0;
  for (int64_t i = r0; i < r1; ++i) {
    const typename G::T* g_row = grad + i * cols;
    const typename P::T* p_row = param + i * cols;
    double r_acc[kLanes] = {};
    int64_t j = c0;
    for (; j + kLanes <= c1; j += kLanes) {
      for (int l = 0; l < kLanes; ++l) {
        stats_element<P, G>(g_row[j + l], p_row[j + l], s, r_acc[l], col_part[j + l - c0],
                            g_acc[l], p_acc[l], any_bad);
      }
    }
    for (int l = 0; j < c1; ++j, ++l) {
      stats_element<P, G>(g_row[j], p_row[j], s, r_acc[l], col_part[j - c0], g_acc[l],
                          p_acc[l], any_bad);
    }
    double total = 0.0;
    for (int l = 0; l < kLanes; ++l) total += r_acc[l];
    row_part[i] = total;
  }
  for (int l = 0; l < kLanes; ++l) {
    part.sumsq += g_acc[l];
    part.p_sumsq += p_acc[l];
  }
  part.bad |= any_bad;
}

// Calls f(row, col_begin, col_end, flat_begin) for the row segments of [begin, end).
template <class F>
void for_row_segments(int64_t begin, int64_t end, int64_t cols, F&& f) {
  while (begin < end) {
    const int64_t i = begin / cols, j0 = begin % cols;
    const int64_t j1 = std::min(cols, j0 + (end - begin));
    f(i, j0, j1, begin);
    begin += j1 - j0;
  }
}

// The squared update of one element of pass B, in double.
template <class G>
double norm_term(const typename G::T& grad, float r, float c, const adalomo::GradScalars& s) {
  uint32_t bad;
  const float update = lomo::mul_rn(lomo::mul_rn(r, c), adalomo::grad_g(G::load(grad), s, bad));
  return static_cast<double>(update) * static_cast<double>(update);
}

// Passes B and C over elements [begin, end) of `grad` (and `param`), which hold the flat
// elements from `offset` of the [rows, cols] matrix: element k is the matrix's offset + k.
template <class G>
double norm_span(const typename G::T* grad, const float* R, const float* c, float mean,
                 int64_t cols, int64_t offset, int64_t begin, int64_t end,
                 const adalomo::GradScalars& s) {
  double acc[kLanes] = {};
  for_row_segments(offset + begin, offset + end, cols, [&](int64_t i, int64_t j0, int64_t j1,
                                                           int64_t flat) {
    const float r = adalomo::rsqrt_f(R[i] / mean);
    // The segment's gradient and column factors, from column j0.
    const typename G::T* g_seg = grad + (flat - offset);
    const float* c_seg = c + j0;
    const int64_t width = j1 - j0;
    // Lanes restart at each segment: a fixed order, and a lane loop the compiler vectorises.
    int64_t k = 0;
    for (; k + kLanes <= width; k += kLanes) {
#pragma omp simd  // independent lanes: vectorised without reassociating any sum
      for (int l = 0; l < kLanes; ++l) acc[l] += norm_term<G>(g_seg[k + l], r, c_seg[k + l], s);
    }
    for (int l = 0; k < width; ++k, ++l) acc[l] += norm_term<G>(g_seg[k], r, c_seg[k], s);
  });
  double total = 0.0;
  for (int l = 0; l < kLanes; ++l) total += acc[l];
  return total;
}

// The write-back of element `index` (its flat index in the whole parameter: the key of
// stochastic rounding, lomo::store_rounded).
template <class P, bool kStochastic>
LOMO_INLINE typename P::T rounded(float value, int64_t index, uint32_t key) {
  return lomo::store_rounded<P, kStochastic>(value, static_cast<uint32_t>(index),
                                             static_cast<uint32_t>(index >> 32), key);
}

template <class P, class G, bool kStochastic>
void apply_span(typename P::T* param, const typename G::T* grad, const float* R,
                const float* c, float mean, int64_t cols, int64_t offset, int64_t begin,
                int64_t end, const adalomo::GradScalars& s, const adalomo::StepScalars& step,
                uint32_t key) {
  for_row_segments(offset + begin, offset + end, cols, [&](int64_t i, int64_t j0, int64_t j1,
                                                           int64_t flat) {
    const float r = adalomo::rsqrt_f(R[i] / mean);
    // The segment's elements, from column j0; `flat` is the first one's index in the matrix.
    typename P::T* p_seg = param + (flat - offset);
    const typename G::T* g_seg = grad + (flat - offset);
    for (int64_t k = 0; k < j1 - j0; ++k) {
      uint32_t bad;
      const float update = lomo::mul_rn(lomo::mul_rn(r, c[j0 + k]),
                                        adalomo::grad_g(G::load(g_seg[k]), s, bad));
      p_seg[k] = rounded<P, kStochastic>(adalomo::apply(P::load(p_seg[k]), update, step),
                                         flat + k, key);
    }
  });
}

template <class P, class G>
Partial vector_stats_span(const typename G::T* grad, const typename P::T* param,
                          const float* v, int64_t begin, int64_t end,
                          const adalomo::GradScalars& s, float b, float omb, float eps0) {
  double u_acc[kLanes] = {}, p_acc[kLanes] = {};
  uint32_t any_bad = 0;
  for (int64_t k = begin; k < end; ++k) {
    uint32_t bad;
    const float g = adalomo::grad_g(G::load(grad[k]), s, bad);
    const float update =
        lomo::mul_rn(adalomo::rsqrt_f(adalomo::moment(v[k], g, b, omb, eps0)), g);
    const double p = static_cast<double>(P::load(param[k]));
    u_acc[k % kLanes] += static_cast<double>(update) * static_cast<double>(update);
    p_acc[k % kLanes] += p * p;
    any_bad |= bad;
  }
  Partial out;
  for (int l = 0; l < kLanes; ++l) {
    out.sumsq += u_acc[l];
    out.p_sumsq += p_acc[l];
  }
  out.bad = any_bad;
  return out;
}

// Elements [begin, end) of param, grad and v, which hold the vector's from `offset`.
template <class P, class G, bool kStochastic>
void vector_apply_span(typename P::T* param, const typename G::T* grad, float* v,
                       int64_t offset, int64_t begin, int64_t end,
                       const adalomo::GradScalars& s, float b, float omb, float eps0,
                       const adalomo::StepScalars& step, uint32_t key) {
  for (int64_t k = begin; k < end; ++k) {
    uint32_t bad;
    const float g = adalomo::grad_g(G::load(grad[k]), s, bad);
    const float v_new = adalomo::moment(v[k], g, b, omb, eps0);
    v[k] = v_new;
    param[k] = rounded<P, kStochastic>(
        adalomo::apply(P::load(param[k]), lomo::mul_rn(adalomo::rsqrt_f(v_new), g), step),
        offset + k, key);
  }
}
