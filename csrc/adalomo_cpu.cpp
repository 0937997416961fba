// CPU kernels of the fused AdaLomo passes, with their torch binding.
// Semantics: lomo_kernels/ops/adalomo_reference.py (fp32 math; reductions here are
// accumulated in double in fixed blocks, so results do not depend on scheduling).
//
// Threads: at::parallel_for over blocks of rows and columns (factored tensors) or over
// fixed 32K-element chunks (1-D tensors and the elementwise passes). Temporaries are
// per-block vectors of at most rows or cols entries, never a copy of a whole tensor.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
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
using binding::dispatch_dtype;

// Runtime scalars (lr, beta2, inv_scale, clip_coef, skip_if) are read on the CPU.
float read_scalar(const at::Tensor& t, const char* name) {
  return binding::read_scalar(t, c10::kCPU, name);
}

float read_factor(const OptTensor& t, const char* name) {
  return binding::read_factor(t, c10::kCPU, name);
}

adalomo::GradScalars grad_scalars(const OptTensor& inv_scale, std::optional<double> clip_value,
                                  const OptTensor& clip_coef) {
  adalomo::GradScalars s;
  s.inv_scale = read_factor(inv_scale, "inv_scale");
  s.clip = clip_value.has_value() ? static_cast<float>(*clip_value)
                                  : std::numeric_limits<float>::infinity();
  s.coef = read_factor(clip_coef, "clip_coef");
  return s;
}

// (b, 1 - b) in fp32, as the reference forms them from a tensor beta2.
std::pair<float, float> beta_pair(const at::Tensor& beta2) {
  const float b = read_scalar(beta2, "beta2");
  return {b, lomo::sub_rn(1.0f, b)};
}

// The write-back scalars (passes C and C1) of `n` elements from the workspace sums, lr read
// from its tensor. Called before the skip test: lr is checked even when the step is skipped.
adalomo::StepScalars write_back_step(const float* stats, int64_t n, const at::Tensor& lr,
                                     double eps1, double clip_threshold, double weight_decay) {
  return adalomo::step_scalars(stats, static_cast<float>(n), read_scalar(lr, "lr"),
                               static_cast<float>(eps1), static_cast<float>(clip_threshold),
                               static_cast<float>(weight_decay));
}

// The slots after the row and column sums of a checked workspace.
float* workspace_stats(at::Tensor& workspace) {
  return workspace.data_ptr<float>() + workspace.numel() - adalomo::kNumSlots;
}

// True when this call must do nothing: the SKIP slot or the caller's skip_if is non-zero.
bool skipped_on_entry(const float* stats, const OptTensor& skip_if) {
  if (stats[adalomo::kSkip] != 0.0f) return true;
  return skip_if.has_value() && read_scalar(*skip_if, "skip_if") != 0.0f;  // nan skips too
}

// The stochastic-rounding key of a write-back pass (bf16 and fp16 parameters; csrc/lomo_cpu.cpp
// forms it the same way), or nullopt to round to nearest: read (and seed_step checked) only
// when stochastic rounding applies, before anything is written.
std::optional<uint32_t> rounding_key(const at::Tensor& param, bool stochastic_rounding,
                                     uint64_t seed, const OptTensor& seed_step) {
  const at::ScalarType type = param.scalar_type();
  if (!stochastic_rounding || (type != at::kBFloat16 && type != at::kHalf)) return std::nullopt;
  const int64_t* step = binding::seed_step_ptr(seed_step, c10::kCPU);
  return lomo::rounding_key(lomo::seed_lo_mixed(seed), lomo::seed_hi_salted(seed),
                            step == nullptr ? 0u : static_cast<uint32_t>(*step));
}

// f(std::true_type{}) when `key` holds a stochastic-rounding key, f(std::false_type{}) to
// round to nearest: the loops are instantiated for each.
template <class F>
void with_rounding(const std::optional<uint32_t>& key, F&& f) {
  if (key.has_value()) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
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

// ----------------------------------------------------------------------------- factored

void factored_stats_(const at::Tensor& grad, const at::Tensor& param, at::Tensor workspace,
                     const OptTensor& found_inf, const OptTensor& skip_if, int64_t cols,
                     const OptTensor& inv_scale, std::optional<double> clip_value) {
  const int64_t rows = binding::check_adalomo_stats(grad, param, workspace, cols, c10::kCPU);
  float* stats = workspace_stats(workspace);
  const cpu_isa::Level level = cpu_isa::active();  // may refuse: before any write
  // Scalars are checked even when the step is skipped, as the CUDA binding does. No clip
  // coefficient here: the moments pass applies it.
  const adalomo::GradScalars s = grad_scalars(inv_scale, clip_value, std::nullopt);
  if (skipped_on_entry(stats, skip_if)) {
    stats[adalomo::kSkip] = 1.0f;
    return;
  }
  const Blocks blocks = make_blocks(rows, cols);
  const int64_t n_blocks = blocks.row_blocks * blocks.col_blocks;
  // Partials: row sums per column block, column sums per row block, h^2 and p^2 per block.
  std::vector<double> row_part(static_cast<size_t>(blocks.col_blocks * rows), 0.0);
  std::vector<double> col_part(static_cast<size_t>(blocks.row_blocks * cols), 0.0);
  std::vector<Partial> parts(static_cast<size_t>(n_blocks));
  binding::dispatch_param_grad(param, grad, [&](auto p_tag, auto g_tag) {
    using P = decltype(p_tag);
    using G = decltype(g_tag);
    const auto* g = binding::elements<G>(grad);
    const auto* p = binding::elements<P>(param);
    const auto block_stats = LOMO_AT_LEVEL(level, stats_block<P, G>);
    at::parallel_for(0, n_blocks, 1, [&](int64_t first, int64_t last) {
      for (int64_t b = first; b < last; ++b) {
        const int64_t rb = b / blocks.col_blocks, cb = b % blocks.col_blocks;
        const int64_t r0 = blocks.row_begin(rb, rows), r1 = blocks.row_begin(rb + 1, rows);
        const int64_t c0 = blocks.col_begin(cb, cols), c1 = blocks.col_begin(cb + 1, cols);
        block_stats(g, p, cols, r0, r1, c0, c1, s, row_part.data() + cb * rows,
                    col_part.data() + rb * cols + c0, parts[b]);
      }
    });
  });
  float* ws = workspace.data_ptr<float>();
  at::parallel_for(0, rows + cols, kGrain, [&](int64_t first, int64_t last) {
    for (int64_t k = first; k < last; ++k) {
      double total = 0.0;
      if (k < rows) {
        for (int64_t cb = 0; cb < blocks.col_blocks; ++cb) total += row_part[cb * rows + k];
      } else {
        for (int64_t rb = 0; rb < blocks.row_blocks; ++rb) {
          total += col_part[rb * cols + (k - rows)];
        }
      }
      add_to(ws + k, total);
    }
  });
  commit_parts(parts, stats, adalomo::kGSumsq, found_inf);
}

void factored_moments_(at::Tensor exp_avg_sq_row, at::Tensor exp_avg_sq_col,
                       at::Tensor workspace, const at::Tensor& beta2,
                       const OptTensor& clip_coef, double eps0) {
  const int64_t rows = exp_avg_sq_row.numel(), cols = exp_avg_sq_col.numel();
  binding::check_adalomo_moments(exp_avg_sq_row, exp_avg_sq_col, workspace, c10::kCPU);
  float* stats = workspace_stats(workspace);
  const auto [b, omb] = beta_pair(beta2);
  const float coef = read_factor(clip_coef, "clip_coef");
  if (stats[adalomo::kSkip] != 0.0f) return;
  const float eps = static_cast<float>(eps0);
  const float* ws = workspace.data_ptr<float>();
  float* R = exp_avg_sq_row.data_ptr<float>();
  float* C = exp_avg_sq_col.data_ptr<float>();
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

// c_j = rsqrt(C_j): one vector per call (cols entries), reused by every row.
std::vector<float> col_factors(const at::Tensor& exp_avg_sq_col) {
  const float* C = exp_avg_sq_col.const_data_ptr<float>();
  std::vector<float> c(static_cast<size_t>(exp_avg_sq_col.numel()));
  for (size_t j = 0; j < c.size(); ++j) c[j] = adalomo::rsqrt_f(C[j]);
  return c;
}

void factored_norm_(const at::Tensor& grad, const at::Tensor& exp_avg_sq_row,
                    const at::Tensor& exp_avg_sq_col, at::Tensor workspace,
                    const OptTensor& inv_scale, std::optional<double> clip_value,
                    const OptTensor& clip_coef) {
  const int64_t rows = exp_avg_sq_row.numel(), cols = exp_avg_sq_col.numel();
  binding::check_adalomo_moments(exp_avg_sq_row, exp_avg_sq_col, workspace, c10::kCPU);
  binding::check_adalomo_tile(grad, exp_avg_sq_row, exp_avg_sq_col, c10::kCPU, "grad");
  float* stats = workspace_stats(workspace);
  const cpu_isa::Level level = cpu_isa::active();  // may refuse: before any write
  const adalomo::GradScalars s = grad_scalars(inv_scale, clip_value, clip_coef);
  if (stats[adalomo::kSkip] != 0.0f) return;
  const float mean = stats[adalomo::kRSum] / static_cast<float>(rows);
  const std::vector<float> c = col_factors(exp_avg_sq_col);
  const float* R = exp_avg_sq_row.const_data_ptr<float>();
  std::vector<double> partial;
  dispatch_dtype(grad.scalar_type(), "grad", [&](auto g_tag) {
    using G = decltype(g_tag);
    const auto* g = binding::elements<G>(grad);
    const auto span_norm = LOMO_AT_LEVEL(level, norm_span<G>);
    partial = map_chunks<double>(grad.numel(), [&](int64_t begin, int64_t end) {
      return span_norm(g, R, c.data(), mean, cols, begin, end, s);
    });
  });
  double total = 0.0;
  for (double v : partial) total += v;
  add_to(stats + adalomo::kUSumsq, total);
}

void factored_apply_(at::Tensor param, const at::Tensor& grad, const at::Tensor& exp_avg_sq_row,
                     const at::Tensor& exp_avg_sq_col, at::Tensor workspace,
                     const at::Tensor& lr, double eps1, double clip_threshold,
                     double weight_decay, const OptTensor& inv_scale,
                     std::optional<double> clip_value, const OptTensor& clip_coef,
                     bool stochastic_rounding, uint64_t seed, const OptTensor& seed_step) {
  const int64_t rows = exp_avg_sq_row.numel(), cols = exp_avg_sq_col.numel();
  binding::check_adalomo_moments(exp_avg_sq_row, exp_avg_sq_col, workspace, c10::kCPU);
  binding::check_adalomo_tile(param, exp_avg_sq_row, exp_avg_sq_col, c10::kCPU, "param");
  binding::check_adalomo_tile(grad, exp_avg_sq_row, exp_avg_sq_col, c10::kCPU, "grad");
  float* stats = workspace_stats(workspace);
  const cpu_isa::Level level = cpu_isa::active();  // may refuse: before any write
  const adalomo::GradScalars s = grad_scalars(inv_scale, clip_value, clip_coef);
  const int64_t n = param.numel();
  const adalomo::StepScalars step =
      write_back_step(stats, n, lr, eps1, clip_threshold, weight_decay);
  const std::optional<uint32_t> key =
      rounding_key(param, stochastic_rounding, seed, seed_step);
  if (stats[adalomo::kSkip] != 0.0f) return;
  const float mean = stats[adalomo::kRSum] / static_cast<float>(rows);
  const std::vector<float> c = col_factors(exp_avg_sq_col);
  const float* R = exp_avg_sq_row.const_data_ptr<float>();
  binding::dispatch_param_grad(param, grad, [&](auto p_tag, auto g_tag) {
    using P = decltype(p_tag);
    using G = decltype(g_tag);
    auto* p = binding::mutable_elements<P>(param);
    const auto* g = binding::elements<G>(grad);
    with_rounding(key, [&](auto stochastic) {
      constexpr bool kStochastic = decltype(stochastic)::value && P::kRoundsStochastically;
      const auto span_apply = LOMO_AT_LEVEL(level, apply_span<P, G, kStochastic>);
      at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
        span_apply(p, g, R, c.data(), mean, cols, begin, end, s, step, key.value_or(0u));
      });
    });
  });
}

// ----------------------------------------------------------------------------- 1-D

void vector_stats_(const at::Tensor& grad, const at::Tensor& param,
                   const at::Tensor& exp_avg_sq, at::Tensor workspace,
                   const OptTensor& found_inf, const OptTensor& skip_if,
                   const at::Tensor& beta2, double eps0, const OptTensor& inv_scale,
                   std::optional<double> clip_value, const OptTensor& clip_coef) {
  const int64_t n = param.numel();
  binding::check_adalomo_vector(grad, param, exp_avg_sq, workspace, c10::kCPU);
  float* stats = workspace_stats(workspace);
  const cpu_isa::Level level = cpu_isa::active();  // may refuse: before any write
  const adalomo::GradScalars s = grad_scalars(inv_scale, clip_value, clip_coef);
  const auto [b, omb] = beta_pair(beta2);
  if (skipped_on_entry(stats, skip_if)) {
    stats[adalomo::kSkip] = 1.0f;
    return;
  }
  const float eps = static_cast<float>(eps0);
  const float* v = exp_avg_sq.const_data_ptr<float>();
  std::vector<Partial> partial;
  binding::dispatch_param_grad(param, grad, [&](auto p_tag, auto g_tag) {
    using P = decltype(p_tag);
    using G = decltype(g_tag);
    const auto* g = binding::elements<G>(grad);
    const auto* p = binding::elements<P>(param);
    const auto span_stats = LOMO_AT_LEVEL(level, vector_stats_span<P, G>);
    partial = map_chunks<Partial>(n, [&](int64_t begin, int64_t end) {
      return span_stats(g, p, v, begin, end, s, b, omb, eps);
    });
  });
  commit_parts(partial, stats, adalomo::kUSumsq, found_inf);
}

void vector_apply_(at::Tensor param, const at::Tensor& grad, at::Tensor exp_avg_sq,
                   at::Tensor workspace, const at::Tensor& beta2, double eps0,
                   const at::Tensor& lr, double eps1, double clip_threshold,
                   double weight_decay, const OptTensor& inv_scale,
                   std::optional<double> clip_value, const OptTensor& clip_coef,
                   bool stochastic_rounding, uint64_t seed, const OptTensor& seed_step) {
  const int64_t n = param.numel();
  binding::check_adalomo_vector(grad, param, exp_avg_sq, workspace, c10::kCPU);
  float* stats = workspace_stats(workspace);
  const cpu_isa::Level level = cpu_isa::active();  // may refuse: before any write
  const adalomo::GradScalars s = grad_scalars(inv_scale, clip_value, clip_coef);
  const auto [b, omb] = beta_pair(beta2);
  const adalomo::StepScalars step =
      write_back_step(stats, n, lr, eps1, clip_threshold, weight_decay);
  const std::optional<uint32_t> key =
      rounding_key(param, stochastic_rounding, seed, seed_step);
  if (stats[adalomo::kSkip] != 0.0f) return;
  const float eps = static_cast<float>(eps0);
  float* v = exp_avg_sq.data_ptr<float>();
  binding::dispatch_param_grad(param, grad, [&](auto p_tag, auto g_tag) {
    using P = decltype(p_tag);
    using G = decltype(g_tag);
    auto* p = binding::mutable_elements<P>(param);
    const auto* g = binding::elements<G>(grad);
    with_rounding(key, [&](auto stochastic) {
      constexpr bool kStochastic = decltype(stochastic)::value && P::kRoundsStochastically;
      const auto span_apply = LOMO_AT_LEVEL(level, vector_apply_span<P, G, kStochastic>);
      at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
        span_apply(p, g, v, begin, end, s, b, omb, eps, step, key.value_or(0u));
      });
    });
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lomo_kernels AdaLomo CPU kernels";
  op_bindings::def_adalomo_ops(m, &factored_stats_, &factored_moments_, &factored_norm_,
                               &factored_apply_, &vector_stats_, &vector_apply_);
  cpu_isa::def_bindings(m);
}
