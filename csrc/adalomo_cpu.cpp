// CPU kernels of the fused AdaLomo passes, with their torch binding.
// Semantics: lomo_kernels/ops/adalomo/reference.py (fp32 math; reductions here are
// accumulated in double in fixed blocks, so results do not depend on scheduling).
//
// Threads: at::parallel_for over blocks of rows and columns (factored tensors) or over
// fixed 32K-element chunks (1-D tensors and the elementwise passes). Temporaries are
// per-block vectors of at most rows or cols entries, never a copy of a whole tensor.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "adalomo_math.h"
#include "binding.h"
#include "op_bindings.h"

// What the loops and the bindings share.
namespace adalomo_cpu {

// Independent accumulators so the row loops vectorise (no reassociation is allowed).
constexpr int kLanes = 8;

// One block's share of a stats pass: a sum of squares (of h in pass A, of the update in pass
// A1), the sum of p^2 and the non-finite flag.
struct Partial {
  double sumsq = 0.0, p_sumsq = 0.0;
  uint32_t bad = 0;
};

}  // namespace adalomo_cpu

using adalomo_cpu::kLanes;
using adalomo_cpu::Partial;

// The loops of adalomo_cpu_loops.h at every level (loops_baseline::, loops_avx2::, ...).
#define LOMO_CPU_LOOPS "adalomo_cpu_loops.h"
#include "cpu_levels.h"

namespace {

using binding::OptTensor;

// Large enough to amortise a thread wake-up, small enough to split mid-sized tensors.
constexpr int64_t kGrain = 32768;

// Runtime scalars (lr, beta2, inv_scale, clip_coef, skip_if) are read on the CPU.
float read_scalar(const at::Tensor& t, const char* name) {
  return binding::read_scalar(t, c10::kCPU, name);
}

// (b, 1 - b) in fp32, as the reference forms them from a tensor beta2.
std::pair<float, float> beta_pair(const at::Tensor& beta2) {
  const float b = read_scalar(beta2, "beta2");
  return {b, lomo::sub_rn(1.0f, b)};
}

// The slots after the row and column sums of a checked workspace.
float* workspace_stats(const at::Tensor& workspace) {
  return workspace.data_ptr<float>() + workspace.numel() - adalomo::kNumSlots;
}

// True when this call must do nothing: the SKIP slot or the caller's skip_if is non-zero.
bool skipped_on_entry(const float* stats, const OptTensor& skip_if) {
  if (stats[adalomo::kSkip] != 0.0f) return true;
  return skip_if.has_value() && read_scalar(*skip_if, "skip_if") != 0.0f;  // nan skips too
}

void add_to(float* dst, double value) {
  *dst = static_cast<float>(static_cast<double>(*dst) + value);
}

// f(begin, end) of each fixed kGrain-element chunk of [0, n), one task per chunk, in chunk
// order: partial results combined in that order do not depend on the thread count.
template <class R, class F>
std::vector<R> map_chunks(int64_t n, F&& f) {
  std::vector<R> out(static_cast<size_t>((n + kGrain - 1) / kGrain));
  at::parallel_for(0, static_cast<int64_t>(out.size()), 1, [&](int64_t first, int64_t last) {
    for (int64_t k = first; k < last; ++k) out[k] = f(k * kGrain, std::min(n, (k + 1) * kGrain));
  });
  return out;
}

// A split of [rows, cols] into row_blocks x col_blocks blocks of work, one per thread at
// most; small tensors run on the calling thread.
struct Blocks {
  int64_t row_blocks, col_blocks;
  int64_t row_begin(int64_t b, int64_t rows) const { return rows * b / row_blocks; }
  int64_t col_begin(int64_t b, int64_t cols) const { return cols * b / col_blocks; }
};

Blocks make_blocks(int64_t rows, int64_t cols) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t by_size = std::max<int64_t>(1, rows * cols / kGrain);
  const int64_t total = std::min(threads, by_size);
  Blocks b;
  b.row_blocks = std::min(total, rows);
  b.col_blocks = std::max<int64_t>(1, std::min(total / b.row_blocks, cols / 1024));
  return b;
}

// Adds the blocks' sums, in block order (so the result does not depend on the threads), to
// the workspace slot `slot` and P_SUMSQ; a non-finite gradient marks the tensor skipped and
// raises found_inf.
void commit_parts(const std::vector<Partial>& parts, float* stats, int slot,
                  const OptTensor& found_inf) {
  Partial total;
  for (const Partial& part : parts) {
    total.sumsq += part.sumsq;
    total.p_sumsq += part.p_sumsq;
    total.bad |= part.bad;
  }
  add_to(stats + slot, total.sumsq);
  add_to(stats + adalomo::kPSumsq, total.p_sumsq);
  if (total.bad != 0) {
    stats[adalomo::kSkip] = 1.0f;
    binding::raise_found_inf(found_inf, c10::kCPU);
  }
}

// How every pass but the moments' begins, in this order: its operands checked, then the
// workspace's slots, the CPU level (which may refuse: before any write) and the gradient's
// scalars (checked even when the step is skipped, as the CUDA binding does).
struct PassStart {
  float* stats;
  cpu_isa::Level level;
  adalomo::GradScalars grad;
};

template <class Args>
PassStart start_pass(const Args& a) {
  binding::check_operands(a, c10::kCPU);
  PassStart out;
  out.stats = workspace_stats(a.workspace);
  out.level = cpu_isa::active();
  out.grad = binding::read_grad_scalars(a.grad_args);
  return out;
}

// What a write-back pass (C, C1) reads before its skip test, so that a skipped step checks
// its arguments too (lr, seed_step): the step's scalars from the workspace sums over `numel`
// elements (the whole tensor's), and the rounding.
struct WriteBack {
  adalomo::StepScalars step;
  bool stochastic;
  uint32_t key;  // the stochastic-rounding key; 0 to round to nearest
};

WriteBack prepare_write_back(const float* stats, const at::Tensor& param, int64_t numel,
                             const op_bindings::StepArgs& step,
                             const op_bindings::RoundingArgs& rounding) {
  WriteBack out;
  out.step = adalomo::step_scalars(stats, static_cast<float>(numel),
                                   read_scalar(step.lr, "lr"), static_cast<float>(step.eps1),
                                   static_cast<float>(step.clip_threshold),
                                   static_cast<float>(step.weight_decay));
  out.stochastic = binding::rounds_stochastically(param, rounding);
  out.key = out.stochastic ? binding::rounding_key(rounding) : 0u;
  return out;
}

// ----------------------------------------------------------------------------- factored

// Calls f(first row, first column, rows, columns, start in the slice) for each rectangle
// the flat elements [offset, offset + n) of a [*, cols] matrix make: a partial first row,
// whole rows, a partial last row, each present only when non-empty (reference.row_pieces).
template <class F>
void for_pieces(int64_t offset, int64_t n, int64_t cols, F&& f) {
  const int64_t end = offset + n;
  for (int64_t pos = offset; pos < end;) {
    const int64_t row = pos / cols, col = pos % cols;
    const bool partial = col != 0 || end - pos < cols;
    const int64_t rows = partial ? 1 : (end - pos) / cols;
    const int64_t width = partial ? std::min(cols - col, end - pos) : cols;
    f(row, col, rows, width, pos - offset);
    pos += rows * width;
  }
}

// Pass A over one rectangle of `rows` x `width` elements, its first at g and p, rows
// `stride` apart: its row and column sums are added to row_sums[0, rows) and
// col_sums[0, width) (the workspace's entries of its first row and column), its blocks' sums
// of h^2 and p^2 appended to `parts` in block order.
template <class BlockStats, class GT, class PT>
void stats_rect(BlockStats block_stats, const GT* g, const PT* p, int64_t stride, int64_t rows,
                int64_t width, const adalomo::GradScalars& s, float* row_sums, float* col_sums,
                std::vector<Partial>& parts) {
  const Blocks blocks = make_blocks(rows, width);
  const int64_t n_blocks = blocks.row_blocks * blocks.col_blocks;
  // Partials: row sums per column block, column sums per row block, h^2 and p^2 per block.
  std::vector<double> row_part(static_cast<size_t>(blocks.col_blocks * rows), 0.0);
  std::vector<double> col_part(static_cast<size_t>(blocks.row_blocks * width), 0.0);
  const size_t first_part = parts.size();
  parts.resize(first_part + static_cast<size_t>(n_blocks));
  at::parallel_for(0, n_blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      const int64_t rb = b / blocks.col_blocks, cb = b % blocks.col_blocks;
      const int64_t r0 = blocks.row_begin(rb, rows), r1 = blocks.row_begin(rb + 1, rows);
      const int64_t c0 = blocks.col_begin(cb, width), c1 = blocks.col_begin(cb + 1, width);
      block_stats(g, p, stride, r0, r1, c0, c1, s, row_part.data() + cb * rows,
                  col_part.data() + rb * width + c0, parts[first_part + b]);
    }
  });
  at::parallel_for(0, rows + width, kGrain, [&](int64_t first, int64_t last) {
    for (int64_t k = first; k < last; ++k) {
      double total = 0.0;
      if (k < rows) {
        for (int64_t cb = 0; cb < blocks.col_blocks; ++cb) total += row_part[cb * rows + k];
        add_to(row_sums + k, total);
      } else {
        for (int64_t rb = 0; rb < blocks.row_blocks; ++rb) {
          total += col_part[rb * width + (k - rows)];
        }
        add_to(col_sums + (k - rows), total);
      }
    }
  });
}

// grad and param hold the flat elements [offset, offset + numel) of the [rows, cols] matrix
// whose sums the workspace holds (the whole of it at offset 0).
void factored_stats_(const op_bindings::FactoredStats& a) {
  const auto [stats, level, s] = start_pass(a);
  const int64_t cols = a.cols, rows = binding::factored_rows(a.workspace, cols);
  if (skipped_on_entry(stats, a.skip_if)) {
    stats[adalomo::kSkip] = 1.0f;
    return;
  }
  float* ws = a.workspace.data_ptr<float>();
  std::vector<Partial> parts;
  binding::dispatch_param_grad(a.param, a.grad, [&](auto p_tag, auto g_tag, auto p, auto g) {
    const auto block_stats = LOMO_AT_LEVEL(level, stats_block<decltype(p_tag), decltype(g_tag)>);
    for_pieces(a.offset, a.grad.numel(), cols,
               [&](int64_t row, int64_t col, int64_t n_rows, int64_t width, int64_t start) {
                 stats_rect(block_stats, g + start, p + start, cols, n_rows, width, s, ws + row,
                            ws + rows + col, parts);
               });
  });
  commit_parts(parts, stats, adalomo::kGSumsq, a.found_inf);
}

void factored_moments_(const op_bindings::FactoredMoments& a) {
  const int64_t rows = a.exp_avg_sq_row.numel(), cols = a.exp_avg_sq_col.numel();
  binding::check_operands(a, c10::kCPU);
  float* stats = workspace_stats(a.workspace);
  const auto [b, omb] = beta_pair(a.beta2);
  const float coef = binding::read_factor(a.clip_coef, c10::kCPU, "clip_coef");
  if (stats[adalomo::kSkip] != 0.0f) return;
  const float eps = static_cast<float>(a.eps0);
  const float* ws = a.workspace.data_ptr<float>();
  float* R = a.exp_avg_sq_row.data_ptr<float>();
  float* C = a.exp_avg_sq_col.data_ptr<float>();
  const float fcols = static_cast<float>(cols), frows = static_cast<float>(rows);
  for (int64_t i = 0; i < rows; ++i) {
    R[i] = lomo::mul_rn(R[i], b) + lomo::mul_rn(adalomo::mean_u(ws[i], fcols, coef, eps), omb);
  }
  for (int64_t j = 0; j < cols; ++j) {
    C[j] = lomo::mul_rn(C[j], b) +
           lomo::mul_rn(adalomo::mean_u(ws[rows + j], frows, coef, eps), omb);
  }
  double total = 0.0;
  for (int64_t i = 0; i < rows; ++i) total += R[i];
  stats[adalomo::kRSum] = static_cast<float>(total);
}

// What passes B and C read of the moments: c_j = rsqrt(C_j) (one vector per call, reused by
// every row), the rows' R and mean(R).
struct Factors {
  std::vector<float> c;
  const float* R;
  float mean;
};

Factors factors(const at::Tensor& exp_avg_sq_row, const at::Tensor& exp_avg_sq_col,
                const float* stats) {
  const float* C = exp_avg_sq_col.const_data_ptr<float>();
  Factors out;
  out.c.resize(static_cast<size_t>(exp_avg_sq_col.numel()));
  for (size_t j = 0; j < out.c.size(); ++j) out.c[j] = adalomo::rsqrt_f(C[j]);
  out.R = exp_avg_sq_row.const_data_ptr<float>();
  out.mean = stats[adalomo::kRSum] / static_cast<float>(exp_avg_sq_row.numel());
  return out;
}

void factored_norm_(const op_bindings::FactoredNorm& a) {
  const auto [stats, level, s] = start_pass(a);
  const int64_t cols = a.exp_avg_sq_col.numel();
  if (stats[adalomo::kSkip] != 0.0f) return;
  const Factors f = factors(a.exp_avg_sq_row, a.exp_avg_sq_col, stats);
  std::vector<double> partial;
  binding::dispatch_dtype(a.grad, "grad", [&](auto g_tag, auto g) {
    const auto span_norm = LOMO_AT_LEVEL(level, norm_span<decltype(g_tag)>);
    partial = map_chunks<double>(a.grad.numel(), [&](int64_t begin, int64_t end) {
      return span_norm(g, f.R, f.c.data(), f.mean, cols, a.offset, begin, end, s);
    });
  });
  double total = 0.0;
  for (double v : partial) total += v;
  add_to(stats + adalomo::kUSumsq, total);
}

void factored_apply_(const op_bindings::FactoredApply& a) {
  const auto [stats, level, s] = start_pass(a);
  const int64_t cols = a.exp_avg_sq_col.numel();
  const int64_t matrix = a.exp_avg_sq_row.numel() * cols;
  const WriteBack w = prepare_write_back(stats, a.param, matrix, a.step, a.rounding);
  if (stats[adalomo::kSkip] != 0.0f) return;
  const Factors f = factors(a.exp_avg_sq_row, a.exp_avg_sq_col, stats);
  binding::dispatch_write_back(a.param, a.grad, w.stochastic, [&](auto p_tag, auto g_tag,
                                                                  auto rounding, auto p, auto g) {
    using P = decltype(p_tag);
    using G = decltype(g_tag);
    const auto span_apply = LOMO_AT_LEVEL(level, apply_span<P, G, decltype(rounding)::value>);
    at::parallel_for(0, a.param.numel(), kGrain, [&](int64_t begin, int64_t end) {
      span_apply(p, g, f.R, f.c.data(), f.mean, cols, a.offset, begin, end, s, w.step, w.key);
    });
  });
}

// ----------------------------------------------------------------------------- 1-D

void vector_stats_(const op_bindings::VectorStats& a) {
  const auto [stats, level, s] = start_pass(a);
  const auto [b, omb] = beta_pair(a.beta2);
  if (skipped_on_entry(stats, a.skip_if)) {
    stats[adalomo::kSkip] = 1.0f;
    return;
  }
  const float eps = static_cast<float>(a.eps0);
  const float* v = a.exp_avg_sq.const_data_ptr<float>();
  std::vector<Partial> partial;
  binding::dispatch_param_grad(a.param, a.grad, [&](auto p_tag, auto g_tag, auto p, auto g) {
    const auto span_stats =
        LOMO_AT_LEVEL(level, vector_stats_span<decltype(p_tag), decltype(g_tag)>);
    partial = map_chunks<Partial>(a.param.numel(), [&](int64_t begin, int64_t end) {
      return span_stats(g, p, v, begin, end, s, b, omb, eps);
    });
  });
  commit_parts(partial, stats, adalomo::kUSumsq, a.found_inf);
}

void vector_apply_(const op_bindings::VectorApply& a) {
  const auto [stats, level, s] = start_pass(a);
  const auto [b, omb] = beta_pair(a.beta2);
  const WriteBack w = prepare_write_back(stats, a.param, a.full_numel, a.step, a.rounding);
  if (stats[adalomo::kSkip] != 0.0f) return;
  const float eps = static_cast<float>(a.eps0);
  float* v = a.exp_avg_sq.data_ptr<float>();
  binding::dispatch_write_back(a.param, a.grad, w.stochastic, [&](auto p_tag, auto g_tag,
                                                                  auto rounding, auto p, auto g) {
    using P = decltype(p_tag);
    using G = decltype(g_tag);
    const auto span_apply =
        LOMO_AT_LEVEL(level, vector_apply_span<P, G, decltype(rounding)::value>);
    at::parallel_for(0, a.param.numel(), kGrain, [&](int64_t begin, int64_t end) {
      span_apply(p, g, v, a.offset, begin, end, s, b, omb, eps, w.step, w.key);
    });
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lomo_kernels AdaLomo CPU kernels";
  op_bindings::def_adalomo_ops(m, {&factored_stats_, &factored_moments_, &factored_norm_,
                                  &factored_apply_, &vector_stats_, &vector_apply_});
  cpu_isa::def_bindings(m);
  m.def("_loops_level", &loops_level, "The level of the CPU loops a call runs now");
}
