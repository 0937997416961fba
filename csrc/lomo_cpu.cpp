// CPU kernels of the fused LOMO update and the gradient sum of squares, with their
// torch binding. Semantics: lomo_kernels/ops/lomo_reference.py (bit for bit).
//
// The loops (lomo_cpu_loops.h) are built once per vector level (cpu_levels.h), and each call
// runs the level cpu_isa::active() names: one build runs on any x86-64 and uses AVX2 or
// AVX-512 where the CPU has them. Threads: at::parallel_for, at least 32K elements per thread.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/SmallVector.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>

#include "binding.h"
#include "lomo_math.h"
#include "op_bindings.h"

// The loops of lomo_cpu_loops.h at every level (loops_baseline::, loops_avx2::, ...).
#define LOMO_CPU_LOOPS "lomo_cpu_loops.h"
#include "cpu_levels.h"

namespace {

// Large enough to amortise a thread wake-up, small enough to split mid-sized tensors.
constexpr int64_t kGrain = 32768;

using binding::OptTensor;

// The per-step value of the rounding key: the low 32 bits of seed_step, 0 when absent.
uint32_t read_seed_step(const OptTensor& t) {
  const int64_t* step = binding::seed_step_ptr(t, c10::kCPU);
  return step == nullptr ? 0u : static_cast<uint32_t>(*step);
}

template <class P, class G, bool kStochastic>
bool run_update(at::Tensor& param, const at::Tensor& grad, const lomo::LomoScalars& s,
                uint32_t key, cpu_isa::Level level) {
  const auto span_update = LOMO_AT_LEVEL(level, update_span<P, G, kStochastic>);
  auto* p = binding::mutable_elements<P>(param);
  const auto* g = binding::elements<G>(grad);
  std::atomic<uint32_t> bad{0};
  at::parallel_for(0, param.numel(), kGrain, [&](int64_t begin, int64_t end) {
    if (span_update(p, g, begin, end, s, key) != 0) {
      bad.store(1, std::memory_order_relaxed);
    }
  });
  return bad.load(std::memory_order_relaxed) != 0;
}

void lomo_update_(at::Tensor param, const at::Tensor& grad, const at::Tensor& lr,
                  const OptTensor& inv_scale, std::optional<double> clip_value,
                  const OptTensor& clip_coef, double weight_decay, const OptTensor& found_inf,
                  const OptTensor& skip_if, bool stochastic_rounding, uint64_t seed,
                  const OptTensor& seed_step) {
  binding::check_dense(param, c10::kCPU, "param");
  binding::check_dense(grad, c10::kCPU, "grad");
  TORCH_CHECK(param.numel() == grad.numel(), "lomo_kernels: param and grad differ in numel");
  const cpu_isa::Level level = cpu_isa::active();
  lomo::LomoScalars s;
  s.lr = binding::read_scalar(lr, c10::kCPU, "lr");
  s.decay = lomo::sub_rn(1.0f, lomo::mul_rn(s.lr, static_cast<float>(weight_decay)));
  s.inv_scale = binding::read_factor(inv_scale, c10::kCPU, "inv_scale");
  s.clip = clip_value.has_value() ? static_cast<float>(*clip_value)
                                  : std::numeric_limits<float>::infinity();
  s.coef = binding::read_factor(clip_coef, c10::kCPU, "clip_coef");
  // Stochastic rounding applies to the low-precision parameters (bf16, fp16).
  const bool stochastic =
      stochastic_rounding &&
      (param.scalar_type() == at::kBFloat16 || param.scalar_type() == at::kHalf);
  const uint32_t key = stochastic ? lomo::rounding_key(lomo::seed_lo_mixed(seed),
                                                       lomo::seed_hi_salted(seed),
                                                       read_seed_step(seed_step))
                                  : 0u;
  // Read once before anything is written: found_inf may alias skip_if.
  if (skip_if.has_value() && binding::read_scalar(*skip_if, c10::kCPU, "skip_if") != 0.0f) {
    return;  // nan too
  }

  bool bad = false;
  binding::dispatch_param_grad(param, grad, [&](auto p_tag, auto g_tag) {
    using P = decltype(p_tag);
    using G = decltype(g_tag);
    if constexpr (P::kRoundsStochastically) {
      bad = stochastic ? run_update<P, G, true>(param, grad, s, key, level)
                       : run_update<P, G, false>(param, grad, s, key, level);
    } else {
      bad = run_update<P, G, false>(param, grad, s, key, level);
    }
  });
  binding::bump_version(param);
  if (bad && found_inf.has_value()) {
    binding::raise_found_inf(found_inf, c10::kCPU);
    binding::bump_version(*found_inf);
  }
}

void grad_sumsq_(const at::Tensor& grad, const OptTensor& inv_scale, at::Tensor sumsq,
                 const OptTensor& found_inf) {
  binding::check_dense(grad, c10::kCPU, "grad");
  binding::check_scalar(sumsq, c10::kCPU, "sumsq");
  const cpu_isa::Level level = cpu_isa::active();
  const float inv = binding::read_factor(inv_scale, c10::kCPU, "inv_scale");
  const int64_t n = grad.numel();
  const int64_t chunks = (n + kGrain - 1) / kGrain;
  // Fixed chunks summed in order: the result does not depend on the thread count.
  c10::SmallVector<double, 64> partial(static_cast<size_t>(chunks), 0.0);
  std::atomic<uint32_t> bad{0};
  binding::dispatch_dtype(grad.scalar_type(), "grad", [&](auto g_tag) {
    using G = decltype(g_tag);
    const auto* g = binding::elements<G>(grad);
    const auto span_sumsq = LOMO_AT_LEVEL(level, sumsq_span<G>);
    at::parallel_for(0, chunks, 1, [&](int64_t first, int64_t last) {
      uint32_t local_bad = 0;
      for (int64_t c = first; c < last; ++c) {
        const int64_t begin = c * kGrain;
        partial[c] = span_sumsq(g + begin, std::min(kGrain, n - begin), inv, local_bad);
      }
      if (local_bad != 0) bad.store(1, std::memory_order_relaxed);
    });
  });
  double total = 0.0;
  for (double v : partial) total += v;
  float* out = sumsq.data_ptr<float>();
  *out = static_cast<float>(static_cast<double>(*out) + total);
  binding::bump_version(sumsq);
  if (bad.load(std::memory_order_relaxed) != 0 && found_inf.has_value()) {
    binding::raise_found_inf(found_inf, c10::kCPU);
    binding::bump_version(*found_inf);
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lomo_kernels CPU kernels";
  op_bindings::def_lomo_ops(m, &lomo_update_, &grad_sumsq_);
  cpu_isa::def_bindings(m);
}
