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

#include "adalomo_math.h"
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

// Calls f with the tags of param's and grad's element types.
template <class F>
void dispatch_param_grad(const at::Tensor& param, const at::Tensor& grad, F&& f) {
  dispatch_dtype(param.scalar_type(), "param", [&](auto p_tag) {
    dispatch_dtype(grad.scalar_type(), "grad", [&](auto g_tag) { f(p_tag, g_tag); });
  });
}

// The elements of a checked tensor as the storage type of `Tag` (lomo::Fp32::T, ...).
template <class Tag>
const typename Tag::T* elements(const at::Tensor& t) {
  return static_cast<const typename Tag::T*>(t.const_data_ptr());
}

template <class Tag>
typename Tag::T* mutable_elements(at::Tensor& t) {
  return static_cast<typename Tag::T*>(t.data_ptr());
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

// An fp32 buffer the op writes (moments, workspace): `numel` elements, dense on `device`.
inline void check_fp32(const at::Tensor& t, int64_t numel, c10::DeviceType device,
                       const char* what) {
  check_dense(t, device, what);
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.numel() == numel, "lomo_kernels: ", what,
              " must be fp32 with ", numel, " elements");
}

// An operand whose size another one sets (`as`): `numel` elements, dense on `device`.
inline void check_sized(const at::Tensor& t, int64_t numel, c10::DeviceType device,
                        const char* what, const char* as) {
  check_dense(t, device, what);
  TORCH_CHECK(t.numel() == numel, "lomo_kernels: ", what, " must have ", numel,
              " elements (as ", as, ")");
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

// ----------------------------------------------------------------------------- AdaLomo
// The operands of the AdaLomo passes (adalomo_cpu.cpp, adalomo_cuda_binding.cpp). The workspace
// holds the row and column sums of a [rows, cols] view, then adalomo::kNumSlots slots.

// Pass A: grad and param viewed as [rows, cols] with `cols` columns; returns rows.
inline int64_t check_adalomo_stats(const at::Tensor& grad, const at::Tensor& param,
                                   const at::Tensor& workspace, int64_t cols,
                                   c10::DeviceType device) {
  check_dense(grad, device, "grad");
  check_dense(param, device, "param");
  TORCH_CHECK(cols > 0 && grad.numel() == param.numel() && grad.numel() % cols == 0,
              "lomo_kernels: bad factored shape");
  const int64_t rows = grad.numel() / cols;
  check_fp32(workspace, rows + cols + adalomo::kNumSlots, device, "workspace");
  return rows;
}

// The moments pass, and the moments and workspace of passes B and C.
inline void check_adalomo_moments(const at::Tensor& exp_avg_sq_row,
                                  const at::Tensor& exp_avg_sq_col, const at::Tensor& workspace,
                                  c10::DeviceType device) {
  const int64_t rows = exp_avg_sq_row.numel(), cols = exp_avg_sq_col.numel();
  check_fp32(exp_avg_sq_row, rows, device, "exp_avg_sq_row");
  check_fp32(exp_avg_sq_col, cols, device, "exp_avg_sq_col");
  check_fp32(workspace, rows + cols + adalomo::kNumSlots, device, "workspace");
}

// Passes B and C: grad or param of the moments' rows * cols elements.
inline void check_adalomo_tile(const at::Tensor& t, const at::Tensor& exp_avg_sq_row,
                               const at::Tensor& exp_avg_sq_col, c10::DeviceType device,
                               const char* what) {
  check_sized(t, exp_avg_sq_row.numel() * exp_avg_sq_col.numel(), device, what,
              "the moments' rows * cols");
}

// Passes A1 and C1 of a 1-D parameter.
inline void check_adalomo_vector(const at::Tensor& grad, const at::Tensor& param,
                                 const at::Tensor& exp_avg_sq, const at::Tensor& workspace,
                                 c10::DeviceType device) {
  check_dense(param, device, "param");
  check_sized(grad, param.numel(), device, "grad", "param");
  check_fp32(exp_avg_sq, param.numel(), device, "exp_avg_sq");
  check_fp32(workspace, adalomo::kNumSlots, device, "workspace");
}

}  // namespace binding
