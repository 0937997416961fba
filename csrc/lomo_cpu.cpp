// CPU kernels of the fused LOMO update and the gradient sum of squares, with their
// torch binding. Semantics: lomo_kernels/backends/reference.py (bit for bit).
//
// The hot loops are plain loops over raw pointers with selects instead of branches, so
// GCC/Clang vectorise them (build with -O3 -fno-trapping-math -ffp-contract=off; the first
// lets selects between float values be if-converted, the second keeps the reference's
// rounding). Threads: at::parallel_for over 32K-element chunks.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/SmallVector.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>

#include "lomo_math.h"

namespace {

// Large enough to amortise a thread wake-up, small enough to split mid-sized tensors.
constexpr int64_t kGrain = 32768;

// One span [begin, end) of the update; returns non-zero if any unscaled grad was inf/nan.
template <class P, class G, bool kStochastic>
uint32_t update_span(typename P::T* __restrict param, const typename G::T* __restrict grad,
                     int64_t begin, int64_t end, const lomo::SgdScalars s, uint32_t key) {
  uint32_t any_bad = 0;
  while (begin < end) {
    // The hash takes the index as two 32-bit halves: keep the high half fixed per inner
    // loop so the loop runs on 32-bit lanes.
    const int64_t stop = kStochastic ? std::min(end, ((begin >> 32) + 1) << 32) : end;
    const uint32_t hi = static_cast<uint32_t>(begin >> 32);
    const uint32_t lo = static_cast<uint32_t>(begin);
    typename P::T* __restrict p = param + begin;
    const typename G::T* __restrict g = grad + begin;
    const int64_t n = stop - begin;
    for (int64_t i = 0; i < n; ++i) {
      const typename P::T old = p[i];
      uint32_t bad;
      const float updated = lomo::sgd_element(G::load(g[i]), P::load(old), s, bad);
      typename P::T out;
      if constexpr (kStochastic) {
        out = lomo::f32_to_bf16_sr(
            updated, lomo::random_bits16(lo + static_cast<uint32_t>(i), hi, key));
      } else {
        out = P::round(updated);
      }
      p[i] = bad ? old : out;
      any_bad |= bad;
    }
    begin = stop;
  }
  return any_bad;
}

// Sum of squares of grad * inv_scale over one span, in double; sets bad on inf/nan.
template <class G>
double sumsq_span(const typename G::T* __restrict grad, int64_t n, float inv_scale,
                  uint32_t& bad) {
  // Independent lanes: a single accumulator would serialise the loop (no reassociation).
  constexpr int kLanes = 16;
  double acc[kLanes] = {};
  uint32_t any_bad = 0;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const float v = lomo::mul_rn(G::load(grad[i + j]), inv_scale);
      acc[j] += static_cast<double>(v) * static_cast<double>(v);
      any_bad |= lomo::is_nonfinite(v);
    }
  }
  for (int j = 0; i < n; ++i, ++j) {
    const float v = lomo::mul_rn(G::load(grad[i]), inv_scale);
    acc[j] += static_cast<double>(v) * static_cast<double>(v);
    any_bad |= lomo::is_nonfinite(v);
  }
  for (int width = kLanes / 2; width > 0; width /= 2) {
    for (int j = 0; j < width; ++j) acc[j] += acc[j + width];
  }
  bad |= any_bad;
  return acc[0];
}

template <class F>
void dispatch_dtype(at::ScalarType type, const char* what, F&& f) {
  switch (type) {
    case at::kFloat:
      f(lomo::Fp32{});
      break;
    case at::kHalf:
      f(lomo::Fp16{});
      break;
    case at::kBFloat16:
      f(lomo::Bf16{});
      break;
    default:
      TORCH_CHECK(false, "lomo_kernels: unsupported ", what, " dtype ", type);
  }
}

float read_scalar(const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.numel() == 1 && t.device().is_cpu(),
              "lomo_kernels: scalar tensors must be 1-element fp32 CPU tensors");
  return *t.const_data_ptr<float>();
}

// scalar * tensor[0] in fp32, as reference._effective computes it.
float effective(double scalar, const std::optional<at::Tensor>& t) {
  const float s = static_cast<float>(scalar);
  return t.has_value() ? lomo::mul_rn(read_scalar(*t), s) : s;
}

// Writes through raw pointers bypass autograd's in-place tracking: bump the version counter
// as torch's own in-place ops do, so a stale saved tensor is detected, not silently used.
void bump_version(const at::Tensor& t) {
  if (!t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
}

// Reference semantics: found_inf = max(found_inf, 1).
void raise_found_inf(const std::optional<at::Tensor>& found_inf) {
  if (!found_inf.has_value()) return;
  TORCH_CHECK(found_inf->scalar_type() == at::kFloat && found_inf->numel() == 1,
              "lomo_kernels: found_inf must be a 1-element fp32 tensor");
  float* f = found_inf->data_ptr<float>();
  if (*f < 1.0f) *f = 1.0f;
  bump_version(*found_inf);
}

template <class P, class G, bool kStochastic>
bool run_update(at::Tensor& param, const at::Tensor& grad, const lomo::SgdScalars& s,
                uint32_t key) {
  auto* p = static_cast<typename P::T*>(param.data_ptr());
  const auto* g = static_cast<const typename G::T*>(grad.const_data_ptr());
  std::atomic<uint32_t> bad{0};
  at::parallel_for(0, param.numel(), kGrain, [&](int64_t begin, int64_t end) {
    if (update_span<P, G, kStochastic>(p, g, begin, end, s, key) != 0) {
      bad.store(1, std::memory_order_relaxed);
    }
  });
  return bad.load(std::memory_order_relaxed) != 0;
}

void sgd_update_(at::Tensor param, const at::Tensor& grad, double lr,
                 const std::optional<at::Tensor>& lr_tensor, double inv_scale,
                 const std::optional<at::Tensor>& inv_scale_tensor,
                 std::optional<double> clip_value, double clip_coef,
                 const std::optional<at::Tensor>& clip_coef_tensor, double weight_decay,
                 const std::optional<at::Tensor>& found_inf,
                 const std::optional<at::Tensor>& skip_if, bool stochastic_rounding,
                 int64_t seed_key) {
  TORCH_CHECK(param.device().is_cpu() && grad.device().is_cpu(),
              "lomo_kernels: CPU kernel got a non-CPU tensor");
  TORCH_CHECK(param.is_contiguous() && grad.is_contiguous() && param.numel() == grad.numel(),
              "lomo_kernels: param and grad must be contiguous with the same numel");
  // Read once before anything is written: found_inf may alias skip_if.
  if (skip_if.has_value() && read_scalar(*skip_if) != 0.0f) return;  // nan skips too

  lomo::SgdScalars s;
  s.lr = effective(lr, lr_tensor);
  // A Python-float lr gives a double 1 - lr * wd; a tensor lr gives fp32 arithmetic.
  s.decay = lr_tensor.has_value()
                ? lomo::sub_rn(1.0f, lomo::mul_rn(s.lr, static_cast<float>(weight_decay)))
                : static_cast<float>(1.0 - lr * weight_decay);
  s.inv_scale = effective(inv_scale, inv_scale_tensor);
  s.clip = clip_value.has_value() ? static_cast<float>(*clip_value)
                                  : std::numeric_limits<float>::infinity();
  s.coef = effective(clip_coef, clip_coef_tensor);
  const uint32_t key = static_cast<uint32_t>(seed_key);

  bool bad = false;
  dispatch_dtype(param.scalar_type(), "param", [&](auto p_tag) {
    using P = decltype(p_tag);
    dispatch_dtype(grad.scalar_type(), "grad", [&](auto g_tag) {
      using G = decltype(g_tag);
      if constexpr (std::is_same_v<P, lomo::Bf16>) {
        bad = stochastic_rounding ? run_update<P, G, true>(param, grad, s, key)
                                  : run_update<P, G, false>(param, grad, s, key);
      } else {
        bad = run_update<P, G, false>(param, grad, s, key);
      }
    });
  });
  bump_version(param);
  if (bad) raise_found_inf(found_inf);
}

void grad_sumsq_(const at::Tensor& grad, double inv_scale,
                 const std::optional<at::Tensor>& inv_scale_tensor, at::Tensor sumsq,
                 const std::optional<at::Tensor>& found_inf) {
  TORCH_CHECK(grad.device().is_cpu() && grad.is_contiguous(),
              "lomo_kernels: grad must be a contiguous CPU tensor");
  TORCH_CHECK(sumsq.scalar_type() == at::kFloat && sumsq.numel() == 1,
              "lomo_kernels: sumsq must be a 1-element fp32 tensor");
  const float inv = effective(inv_scale, inv_scale_tensor);
  const int64_t n = grad.numel();
  const int64_t chunks = (n + kGrain - 1) / kGrain;
  // Fixed chunks summed in order: the result does not depend on the thread count.
  c10::SmallVector<double, 64> partial(static_cast<size_t>(chunks), 0.0);
  std::atomic<uint32_t> bad{0};
  dispatch_dtype(grad.scalar_type(), "grad", [&](auto g_tag) {
    using G = decltype(g_tag);
    const auto* g = static_cast<const typename G::T*>(grad.const_data_ptr());
    at::parallel_for(0, chunks, 1, [&](int64_t first, int64_t last) {
      uint32_t local_bad = 0;
      for (int64_t c = first; c < last; ++c) {
        const int64_t begin = c * kGrain;
        partial[c] = sumsq_span<G>(g + begin, std::min(kGrain, n - begin), inv, local_bad);
      }
      if (local_bad != 0) bad.store(1, std::memory_order_relaxed);
    });
  });
  double total = 0.0;
  for (double v : partial) total += v;
  float* out = sumsq.data_ptr<float>();
  *out = static_cast<float>(static_cast<double>(*out) + total);
  bump_version(sumsq);
  if (bad.load(std::memory_order_relaxed) != 0) raise_found_inf(found_inf);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lomo_kernels CPU kernels";
  m.def("sgd_update_", &sgd_update_, "Fused LOMO SGD update of one parameter, in place",
        py::arg("param"), py::arg("grad"), py::arg("lr"), py::arg("lr_tensor"),
        py::arg("inv_scale"), py::arg("inv_scale_tensor"), py::arg("clip_value"),
        py::arg("clip_coef"), py::arg("clip_coef_tensor"), py::arg("weight_decay"),
        py::arg("found_inf"), py::arg("skip_if"), py::arg("stochastic_rounding"),
        py::arg("seed_key"));
  m.def("grad_sumsq_", &grad_sumsq_, "sumsq += sum((grad * inv_scale)^2), in place",
        py::arg("grad"), py::arg("inv_scale"), py::arg("inv_scale_tensor"), py::arg("sumsq"),
        py::arg("found_inf"));
}
