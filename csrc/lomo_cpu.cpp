// CPU kernels of the fused LOMO update, the gradient sum of squares, the gradient
// accumulation and the 8-bit blockwise buffer's ops, with their torch binding. Semantics:
// lomo_kernels/ops/lomo/reference.py (bit for bit).
//
// The loops (lomo_cpu_loops.h, lomo_cpu_int8.h) are built once per vector level
// (cpu_levels.h), and each call runs the level cpu_isa::active() names: one build runs on any
// x86-64 and uses AVX2 or AVX-512 where the CPU has them. Threads: at::parallel_for, at least
// 32K elements per thread.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/SmallVector.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#include "binding.h"
#include "int8_blocks.h"
#include "lomo_math.h"
#include "op_bindings.h"

// The loops of lomo_cpu_loops.h at every level (loops_baseline::, loops_avx2::, ...).
#define LOMO_CPU_LOOPS "lomo_cpu_loops.h"
#include "cpu_levels.h"

namespace {

// Large enough to amortise a thread wake-up, small enough to split mid-sized tensors.
constexpr int64_t kGrain = 32768;

using binding::OptTensor;

// Runs span(begin, end) -> uint32_t over [0, n) on the threads; true when any span returned
// non-zero (saw a non-finite gradient).
template <class Span>
bool any_span(int64_t n, Span&& span) {
  std::atomic<uint32_t> bad{0};
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    if (span(begin, end) != 0) bad.store(1, std::memory_order_relaxed);
  });
  return bad.load(std::memory_order_relaxed) != 0;
}

template <class P, class G, bool kStochastic>
bool run_update(typename P::T* p, const typename G::T* g, int64_t n, int64_t offset,
                const lomo::LomoScalars& s, uint32_t key, cpu_isa::Level level) {
  const auto span_update = LOMO_AT_LEVEL(level, update_span<P, G, kStochastic>);
  return any_span(n, [&](int64_t begin, int64_t end) {
    return span_update(p, g, offset, begin, end, s, key);
  });
}

// found_inf raised (and its version bumped) when a kernel saw a non-finite gradient.
void report_nonfinite(bool bad, const OptTensor& found_inf) {
  if (bad && found_inf.has_value()) {
    binding::raise_found_inf(found_inf, c10::kCPU);
    binding::bump_version(*found_inf);
  }
}

// The update's scalars as the reference forms them: decay = fp32(1 - fp32(lr * wd)).
lomo::LomoScalars update_scalars(const at::Tensor& lr, double weight_decay,
                                 const op_bindings::GradArgs& grad_args) {
  lomo::LomoScalars s;
  s.lr = binding::read_scalar(lr, c10::kCPU, "lr");
  s.decay = lomo::sub_rn(1.0f, lomo::mul_rn(s.lr, static_cast<float>(weight_decay)));
  const lomo::GradScalars g = binding::read_grad_scalars(grad_args);
  s.inv_scale = g.inv_scale;
  s.clip = g.clip;
  s.coef = g.coef;
  return s;
}

// Whether a set skip_if (non-zero, nan too) asks the update to write nothing. Read once,
// before anything is written: found_inf may alias it.
bool skipped(const OptTensor& skip_if) {
  return skip_if.has_value() && binding::read_scalar(*skip_if, c10::kCPU, "skip_if") != 0.0f;
}

void lomo_update_(const op_bindings::LomoUpdate& a) {
  binding::check_operands(a, c10::kCPU);
  const cpu_isa::Level level = cpu_isa::active();
  const lomo::LomoScalars s = update_scalars(a.lr, a.weight_decay, a.grad_args);
  const bool stochastic = binding::rounds_stochastically(a.param, a.rounding);
  const uint32_t key = stochastic ? binding::rounding_key(a.rounding) : 0u;
  if (skipped(a.skip_if)) return;

  bool bad = false;
  binding::dispatch_write_back(
      a.param, a.grad, stochastic, [&](auto p_tag, auto g_tag, auto rounding, auto p, auto g) {
        bad = run_update<decltype(p_tag), decltype(g_tag), decltype(rounding)::value>(
            p, g, a.param.numel(), a.offset, s, key, level);
      });
  binding::bump_version(a.param);
  report_nonfinite(bad, a.found_inf);
}

// Runs span(begin, count, bad) -> double over [0, n) in fixed chunks of `chunk` units and
// returns their results summed in chunk order, so the total does not depend on the thread
// count; `bad` is set when any chunk set its flag.
template <class Span>
double sum_fixed_chunks(int64_t n, int64_t chunk, bool& bad, Span&& span) {
  const int64_t chunks = (n + chunk - 1) / chunk;
  c10::SmallVector<double, 64> partial(static_cast<size_t>(chunks), 0.0);
  std::atomic<uint32_t> any_bad{0};
  at::parallel_for(0, chunks, 1, [&](int64_t first, int64_t last) {
    uint32_t local_bad = 0;
    for (int64_t c = first; c < last; ++c) {
      const int64_t begin = c * chunk;
      partial[c] = span(begin, std::min(chunk, n - begin), local_bad);
    }
    if (local_bad != 0) any_bad.store(1, std::memory_order_relaxed);
  });
  double total = 0.0;
  for (double v : partial) total += v;
  bad = any_bad.load(std::memory_order_relaxed) != 0;
  return total;
}

// sum_fixed_chunks of elements in chunks of kGrain (grad_sumsq_'s chunks, which the
// accumulation's measurement repeats bit for bit).
template <class Span>
double sum_chunks(int64_t n, bool& bad, Span&& span) {
  return sum_fixed_chunks(n, kGrain, bad, std::forward<Span>(span));
}

// sumsq += total, rounded once to fp32.
void add_to_sumsq(const at::Tensor& sumsq, double total) {
  float* out = sumsq.data_ptr<float>();
  *out = static_cast<float>(static_cast<double>(*out) + total);
  binding::bump_version(sumsq);
}

void grad_sumsq_(const op_bindings::GradSumsq& a) {
  binding::check_dense(a.grad, c10::kCPU, "grad");
  binding::check_scalar(a.sumsq, c10::kCPU, "sumsq");
  const cpu_isa::Level level = cpu_isa::active();
  const float inv = binding::read_factor(a.inv_scale, c10::kCPU, "inv_scale");
  bool bad = false;
  double total = 0.0;
  binding::dispatch_dtype(a.grad, "grad", [&](auto g_tag, auto g) {
    const auto span_sumsq = LOMO_AT_LEVEL(level, sumsq_span<decltype(g_tag)>);
    total = sum_chunks(a.grad.numel(), bad, [&](int64_t begin, int64_t count, uint32_t& b) {
      return span_sumsq(g + begin, count, inv, b);
    });
  });
  add_to_sumsq(a.sumsq, total);
  report_nonfinite(bad, a.found_inf);
}

// What an accumulation measures of the values it stores: found_inf alone needs only the
// flag, not the squares.
lomo::Measure measure_of(const OptTensor& sumsq, const OptTensor& found_inf) {
  if (sumsq.has_value()) return lomo::Measure::kSquares;
  return found_inf.has_value() ? lomo::Measure::kFlag : lomo::Measure::kNothing;
}

void grad_accumulate_(const op_bindings::GradAccumulate& a) {
  binding::check_operands(a, c10::kCPU);
  if (a.sumsq.has_value()) binding::check_scalar(*a.sumsq, c10::kCPU, "sumsq");
  const cpu_isa::Level level = cpu_isa::active();
  const float inv = binding::read_factor(a.inv_scale, c10::kCPU, "inv_scale");
  const bool stochastic = binding::rounds_stochastically(a.buffer, a.rounding);
  const uint32_t key = stochastic ? binding::rounding_key(a.rounding) : 0u;
  const lomo::Measure measure = measure_of(a.sumsq, a.found_inf);
  bool bad = false;
  double total = 0.0;
  binding::dispatch_write_back(
      a.buffer, a.grad, stochastic, [&](auto p_tag, auto g_tag, auto rounding, auto b, auto g) {
        lomo::dispatch_bool(a.first, [&](auto first) {
          lomo::dispatch_measure(measure, [&](auto measured) {
            const auto span = LOMO_AT_LEVEL(
                level, accumulate_span<decltype(p_tag), decltype(g_tag), decltype(first)::value,
                                       decltype(rounding)::value, decltype(measured)::value>);
            total = sum_chunks(a.buffer.numel(), bad,
                               [&](int64_t begin, int64_t count, uint32_t& flag) {
                                 return span(b, g, a.offset, begin, count, inv, key, flag);
                               });
          });
        });
      });
  binding::bump_version(a.buffer);
  if (a.sumsq.has_value()) add_to_sumsq(*a.sumsq, total);
  report_nonfinite(bad, a.found_inf);
}

// ----------------------------------------------------------------------------- 8-bit buffer
// int8_blocks.h: int8 codes, one fp32 scale per block of the parameter's flat index.

// Writes through raw pointers: the codes' and the scales' version counters.
void bump_versions(const op_bindings::Int8Buffer& b) {
  binding::bump_version(b.codes);
  binding::bump_version(b.scales);
}

void grad_accumulate_int8_(const op_bindings::GradAccumulateInt8& a) {
  binding::check_dense(a.grad, c10::kCPU, "grad");
  binding::check_int8_buffer(a.buffer, a.grad, c10::kCPU);
  if (a.sumsq.has_value()) binding::check_scalar(*a.sumsq, c10::kCPU, "sumsq");
  const cpu_isa::Level level = cpu_isa::active();
  const float inv = binding::read_factor(a.inv_scale, c10::kCPU, "inv_scale");
  // The codes round stochastically whatever the gradient's dtype.
  const bool stochastic = a.rounding.stochastic_rounding;
  const uint32_t key = stochastic ? binding::rounding_key(a.rounding) : 0u;
  const lomo::Measure measure = measure_of(a.sumsq, a.found_inf);
  const int64_t numel = a.grad.numel(), offset = a.buffer.offset;
  const int64_t blocks = int8_blocks::blocks_of(offset, numel);
  int8_t* codes = a.buffer.codes.data_ptr<int8_t>();
  float* scales = a.buffer.scales.data_ptr<float>();
  bool bad = false;
  double total = 0.0;
  binding::dispatch_dtype(a.grad, "grad", [&](auto g_tag, auto g) {
    lomo::dispatch_bool(a.first, [&](auto first) {
      lomo::dispatch_bool(stochastic, [&](auto rounding) {
        lomo::dispatch_measure(measure, [&](auto measured) {
          const auto span = LOMO_AT_LEVEL(
              level, accumulate_int8_span<decltype(g_tag), decltype(first)::value,
                                          decltype(rounding)::value, decltype(measured)::value>);
          // Chunks of whole blocks of the parameter: the same chunks at any thread count.
          total = sum_fixed_chunks(blocks, kGrain / int8_blocks::kBlock, bad,
                                   [&](int64_t first_block, int64_t count, uint32_t& flag) {
                                     return span(codes, scales, g, offset, numel, first_block,
                                                 count, inv, key, flag);
                                   });
        });
      });
    });
  });
  bump_versions(a.buffer);
  if (a.sumsq.has_value()) add_to_sumsq(*a.sumsq, total);
  report_nonfinite(bad, a.found_inf);
}

void lomo_update_int8_(const op_bindings::LomoUpdateInt8& a) {
  binding::check_dense(a.param, c10::kCPU, "param");
  binding::check_int8_buffer(a.buffer, a.param, c10::kCPU);
  const cpu_isa::Level level = cpu_isa::active();
  const lomo::LomoScalars s = update_scalars(a.lr, a.weight_decay, a.grad_args);
  const bool stochastic = binding::rounds_stochastically(a.param, a.rounding);
  const uint32_t key = stochastic ? binding::rounding_key(a.rounding) : 0u;
  if (skipped(a.skip_if)) return;

  const int8_t* codes = a.buffer.codes.const_data_ptr<int8_t>();
  const float* scales = a.buffer.scales.const_data_ptr<float>();
  const int64_t offset = a.buffer.offset;
  bool bad = false;
  lomo::dispatch_dtype(binding::dtype_code(a.param, "param"), [&](auto p_tag) {
    using P = decltype(p_tag);
    auto* p = binding::mutable_elements<P>(a.param);
    lomo::dispatch_rounding<P>(stochastic, [&](auto rounding) {
      const auto span = LOMO_AT_LEVEL(level, update_int8_span<P, decltype(rounding)::value>);
      bad = any_span(a.param.numel(), [&](int64_t begin, int64_t end) {
        return span(p, codes, scales, offset, begin, end, s, key);
      });
    });
  });
  binding::bump_version(a.param);
  report_nonfinite(bad, a.found_inf);
}

void int8_dequantize_(const op_bindings::Int8Dequantize& a) {
  binding::check_dense(a.out, c10::kCPU, "out");
  binding::check_int8_buffer(a.buffer, a.out, c10::kCPU);
  const cpu_isa::Level level = cpu_isa::active();
  const int8_t* codes = a.buffer.codes.const_data_ptr<int8_t>();
  const float* scales = a.buffer.scales.const_data_ptr<float>();
  const int64_t offset = a.buffer.offset;
  lomo::dispatch_dtype(binding::dtype_code(a.out, "out"), [&](auto o_tag) {
    using P = decltype(o_tag);
    auto* out = binding::mutable_elements<P>(a.out);
    const auto span = LOMO_AT_LEVEL(level, dequantize_int8_span<P>);
    at::parallel_for(0, a.out.numel(), kGrain, [&](int64_t begin, int64_t end) {
      span(out, codes, scales, offset, begin, end);
    });
  });
  binding::bump_version(a.out);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lomo_kernels CPU kernels";
  op_bindings::def_lomo_ops(m, {&lomo_update_, &grad_sumsq_, &grad_accumulate_,
                                &grad_accumulate_int8_, &lomo_update_int8_, &int8_dequantize_});
  cpu_isa::def_bindings(m);
  m.def("_loops_level", &loops_level, "The level of the CPU loops a call runs now");
}
