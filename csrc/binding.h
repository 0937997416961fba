// What every torch binding of the fused ops shares (lomo_cpu.cpp, adalomo_cpu.cpp and the
// CUDA bindings): argument checks, runtime scalars, dtype dispatch, version counters.
//
// The Python public layer checks every argument before anything is written; these checks
// are the last line of defence of a binding called directly. Runtime scalars (lr, beta2,
// inv_scale, clip_coef, skip_if, found_inf, sumsq) are 1-element fp32 tensors on the
// parameter's device: the CPU kernels read them, the CUDA kernels get device pointers.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <optional>

#include "lomo_math.h"

namespace binding {

using OptTensor = std::optional<at::Tensor>;

// Calls f with the lomo::Fp32 / Fp16 / Bf16 tag of `type` (the element types of the math).
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

// The lomo::DtypeCode of a tensor, for the plain-C CUDA launchers.
inline int dtype_code(const at::Tensor& t, const char* what) {
  int code = 0;
  dispatch_dtype(t.scalar_type(), what, [&](auto tag) { code = decltype(tag)::code; });
  return code;
}

// A dense operand (param, grad, moments, workspace): contiguous, on `device`'s type.
inline void check_dense(const at::Tensor& t, c10::DeviceType device, const char* what) {
  TORCH_CHECK(t.device().type() == device && t.is_contiguous(), "lomo_kernels: ", what,
              " must be a contiguous ", c10::DeviceTypeName(device, /*lower_case=*/true),
              " tensor");
}

// A runtime scalar: one element of `dtype` on `device` (the parameter's).
inline void check_scalar(const at::Tensor& t, c10::Device device, const char* what,
                         at::ScalarType dtype = at::kFloat) {
  TORCH_CHECK(t.scalar_type() == dtype && t.numel() == 1 && t.device() == device,
              "lomo_kernels: ", what, " must be a 1-element ", c10::toString(dtype),
              " tensor on ", device);
}

// CPU: the value of a runtime scalar; of an optional multiplier (absent: 1, and x * 1 == x).
inline float read_scalar(const at::Tensor& t, c10::Device device, const char* what) {
  check_scalar(t, device, what);
  return *t.const_data_ptr<float>();
}

inline float read_factor(const OptTensor& t, c10::Device device, const char* what) {
  return t.has_value() ? read_scalar(*t, device, what) : 1.0f;
}

// CUDA: the device pointer of a runtime scalar; nullptr for an absent optional one.
inline float* scalar_ptr(const at::Tensor& t, c10::Device device, const char* what) {
  check_scalar(t, device, what);
  return t.data_ptr<float>();
}

inline float* scalar_ptr(const OptTensor& t, c10::Device device, const char* what) {
  return t.has_value() ? scalar_ptr(*t, device, what) : nullptr;
}

// The rounding seed's per-step part: a 1-element int64 tensor (absent: nullptr).
inline const int64_t* seed_step_ptr(const OptTensor& t, c10::Device device) {
  if (!t.has_value()) return nullptr;
  check_scalar(*t, device, "seed_step", at::kLong);
  return t->const_data_ptr<int64_t>();
}

// Writes through raw pointers bypass autograd's in-place tracking: bump the version counter
// as torch's own in-place ops do, so a stale saved tensor is detected, not silently used.
inline void bump_version(const at::Tensor& t) {
  if (!t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
}

// CPU, reference semantics: found_inf = max(found_inf, 1) (a nan stays nan).
inline void raise_found_inf(const OptTensor& found_inf, c10::Device device) {
  if (!found_inf.has_value()) return;
  float* f = scalar_ptr(*found_inf, device, "found_inf");
  if (*f < 1.0f) *f = 1.0f;
}

}  // namespace binding
