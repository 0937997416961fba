// What every torch binding of the fused ops shares (lomo_cpu.cpp, adalomo_cpu.cpp and the
// CUDA bindings): argument checks, runtime scalars, rounding, dtype dispatch, version counters.
//
// The Python public layer checks every argument before anything is written; these checks
// are the last line of defence of a binding called directly. Runtime scalars (lr, beta2,
// inv_scale, clip_coef, skip_if, found_inf, sumsq) are 1-element fp32 tensors on the
// parameter's device: the CPU kernels read them, the CUDA kernels get device pointers.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <limits>
#include <optional>

#include "adalomo_math.h"
#include "dtype_dispatch.h"
#include "int8_blocks.h"
#include "lomo_math.h"
#include "op_bindings.h"
#include "rounding_args.h"

namespace binding {

using op_bindings::OptTensor;

// The lomo::DtypeCode of a tensor's elements; refused for a dtype the kernels do not take.
inline int dtype_code(const at::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return lomo::kFloat32;
    case at::kHalf:
      return lomo::kFloat16;
    case at::kBFloat16:
      return lomo::kBFloat16;
    default:
      TORCH_CHECK(false, "lomo_kernels: unsupported ", what, " dtype ", t.scalar_type());
  }
}

// The elements of a checked tensor as the storage type of `Tag` (lomo::Fp32::T, ...).
template <class Tag>
const typename Tag::T* elements(const at::Tensor& t) {
  return static_cast<const typename Tag::T*>(t.const_data_ptr());
}

template <class Tag>
typename Tag::T* mutable_elements(const at::Tensor& t) {
  return static_cast<typename Tag::T*>(t.data_ptr());
}

// Calls f(tag, elements) with the lomo::Fp32 / Fp16 / Bf16 tag of t's element type.
template <class F>
void dispatch_dtype(const at::Tensor& t, const char* what, F&& f) {
  lomo::dispatch_dtype(dtype_code(t, what),
                       [&](auto tag) { f(tag, elements<decltype(tag)>(t)); });
}

// Calls f(param tag, grad tag, param's elements, grad's elements) (param's dtype checked first).
template <class F>
void dispatch_param_grad(const at::Tensor& param, const at::Tensor& grad, F&& f) {
  const int param_code = dtype_code(param, "param");
  lomo::dispatch_param_grad(param_code, dtype_code(grad, "grad"), [&](auto p_tag, auto g_tag) {
    f(p_tag, g_tag, elements<decltype(p_tag)>(param), elements<decltype(g_tag)>(grad));
  });
}

// dispatch_param_grad of a write-back: f(param tag, grad tag, its rounding as
// lomo::dispatch_rounding gives it, param's elements to write, grad's elements).
template <class F>
void dispatch_write_back(const at::Tensor& param, const at::Tensor& grad, bool stochastic,
                         F&& f) {
  const int param_code = dtype_code(param, "param");
  lomo::dispatch_write_back(
      param_code, dtype_code(grad, "grad"), stochastic, [&](auto p_tag, auto g_tag, auto sr) {
        f(p_tag, g_tag, sr, mutable_elements<decltype(p_tag)>(param),
          elements<decltype(g_tag)>(grad));
      });
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

// A slice of `numel` elements at flat `offset` of its parameter: offset >= 0 and every flat
// index offset + j, and the end, an int64.
inline void check_offset(int64_t offset, int64_t numel) {
  TORCH_CHECK(offset >= 0, "lomo_kernels: offset must be >= 0, got ", offset);
  TORCH_CHECK(offset <= std::numeric_limits<int64_t>::max() - numel, "lomo_kernels: ", numel,
              " elements at offset ", offset, " end past 2**63 - 1");
}

// A slice of `numel` elements at flat `offset` of a whole of `whole` elements (`what`): the
// offset as check_offset takes it, and the slice's end within the whole.
inline void check_slice_fits(int64_t offset, int64_t numel, int64_t whole, const char* what) {
  check_offset(offset, numel);
  TORCH_CHECK(offset + numel <= whole, "lomo_kernels: ", numel, " elements at offset ", offset,
              " end past ", what, " (", whole, " elements)");
}

// An 8-bit blockwise buffer (int8_blocks.h) of `data`'s elements (param, grad, out): int8
// codes of its numel and fp32 scales one per block they touch, dense on data's device, at an
// offset >= 0.
inline void check_int8_buffer(const op_bindings::Int8Buffer& b, const at::Tensor& data,
                              c10::DeviceType device) {
  check_offset(b.offset, data.numel());
  check_sized(b.codes, data.numel(), device, "codes", "the data");
  TORCH_CHECK(b.codes.scalar_type() == at::kChar, "lomo_kernels: codes must be int8, got ",
              b.codes.scalar_type());
  check_fp32(b.scales, int8_blocks::blocks_of(b.offset, data.numel()), device, "scales");
  TORCH_CHECK(b.codes.device() == data.device() && b.scales.device() == data.device(),
              "lomo_kernels: codes and scales must be on ", data.device());
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

// A clamp bound as fp32: +inf when clipping by value is off.
inline float clip_bound(std::optional<double> clip_value) {
  return clip_value.has_value() ? static_cast<float>(*clip_value)
                                : std::numeric_limits<float>::infinity();
}

// CPU: the gradient's scalars, read in their argument order.
inline lomo::GradScalars read_grad_scalars(const op_bindings::GradArgs& a) {
  lomo::GradScalars s;
  s.inv_scale = read_factor(a.inv_scale, c10::kCPU, "inv_scale");
  s.clip = clip_bound(a.clip_value);
  s.coef = read_factor(a.clip_coef, c10::kCPU, "clip_coef");
  return s;
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

// Whether the write-back to `param` rounds stochastically: when asked, for bf16 and fp16
// parameters (fp32 stores the result exactly).
inline bool rounds_stochastically(const at::Tensor& param, const op_bindings::RoundingArgs& a) {
  const at::ScalarType type = param.scalar_type();
  return a.stochastic_rounding && (type == at::kBFloat16 || type == at::kHalf);
}

// CPU: the stochastic-rounding key of the seed and the per-step value (its low 32 bits; 0
// when absent).
inline uint32_t rounding_key(const op_bindings::RoundingArgs& a) {
  const int64_t* step = seed_step_ptr(a.seed_step, c10::kCPU);
  return lomo::rounding_key(lomo::seed_lo_mixed(a.seed), lomo::seed_hi_salted(a.seed),
                            step == nullptr ? 0u : static_cast<uint32_t>(*step));
}

// CUDA: the write-back's rounding, its key finished on the device from seed_step (checked only
// when the rounding is stochastic).
inline LomoRoundingArgs rounding_args(const at::Tensor& param,
                                      const op_bindings::RoundingArgs& a) {
  LomoRoundingArgs out;
  out.stochastic = rounds_stochastically(param, a) ? 1 : 0;
  out.seed_lo_mixed = lomo::seed_lo_mixed(a.seed);
  out.seed_hi_salted = lomo::seed_hi_salted(a.seed);
  out.seed_step = out.stochastic != 0 ? seed_step_ptr(a.seed_step, param.device()) : nullptr;
  return out;
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

// ----------------------------------------------------------------------------- operands
// The tensor operands of each op, dense on `device`'s type with the sizes the op needs.

// A written tensor (`what`: param, buffer) and its gradient.
inline void check_with_grad(const at::Tensor& t, const at::Tensor& grad, c10::DeviceType device,
                            const char* what) {
  check_dense(t, device, what);
  check_dense(grad, device, "grad");
  if (device == c10::kCPU) {
    TORCH_CHECK(t.numel() == grad.numel(), "lomo_kernels: ", what, " and grad differ in numel");
  } else {
    TORCH_CHECK(grad.device() == t.device() && t.numel() == grad.numel(), "lomo_kernels: ",
                what, " and grad must be on one device with the same numel");
  }
}

inline void check_operands(const op_bindings::LomoUpdate& a, c10::DeviceType device) {
  check_with_grad(a.param, a.grad, device, "param");
  check_offset(a.offset, a.param.numel());
}

inline void check_operands(const op_bindings::GradAccumulate& a, c10::DeviceType device) {
  check_with_grad(a.buffer, a.grad, device, "buffer");
  check_offset(a.offset, a.buffer.numel());
}

// The AdaLomo passes. The workspace holds the row and column sums of a [rows, cols] view,
// then adalomo::kNumSlots slots.

inline void check_workspace(const at::Tensor& workspace, int64_t sums, c10::DeviceType device) {
  check_fp32(workspace, sums + adalomo::kNumSlots, device, "workspace");
}

// Pass A's matrix rows: those the workspace holds sums of (rows + cols + the slots).
inline int64_t factored_rows(const at::Tensor& workspace, int64_t cols) {
  return workspace.numel() - adalomo::kNumSlots - cols;
}

// Pass A: grad and param hold the flat elements [offset, offset + numel) of a [rows, cols]
// matrix with `cols` columns, its rows the workspace's (the whole matrix at offset 0).
inline void check_operands(const op_bindings::FactoredStats& a, c10::DeviceType device) {
  check_dense(a.grad, device, "grad");
  check_dense(a.param, device, "param");
  TORCH_CHECK(a.cols > 0 && a.grad.numel() == a.param.numel(),
              "lomo_kernels: bad factored shape");
  const int64_t rows = factored_rows(a.workspace, a.cols);
  TORCH_CHECK(rows > 0, "lomo_kernels: a workspace of ", a.workspace.numel(),
              " elements holds no row of a matrix of ", a.cols, " columns");
  check_workspace(a.workspace, rows + a.cols, device);
  check_slice_fits(a.offset, a.grad.numel(), rows * a.cols, "the workspace's rows * cols");
}

// The moments and the workspace of the moments pass and passes B and C.
inline void check_moments(const at::Tensor& exp_avg_sq_row, const at::Tensor& exp_avg_sq_col,
                          const at::Tensor& workspace, c10::DeviceType device) {
  const int64_t rows = exp_avg_sq_row.numel(), cols = exp_avg_sq_col.numel();
  check_fp32(exp_avg_sq_row, rows, device, "exp_avg_sq_row");
  check_fp32(exp_avg_sq_col, cols, device, "exp_avg_sq_col");
  check_workspace(workspace, rows + cols, device);
}

// Passes B and C: grad or param holding the flat elements [offset, offset + numel) of the
// moments' rows * cols.
inline void check_tile(const at::Tensor& t, const at::Tensor& exp_avg_sq_row,
                       const at::Tensor& exp_avg_sq_col, int64_t offset, c10::DeviceType device,
                       const char* what) {
  check_dense(t, device, what);
  check_slice_fits(offset, t.numel(), exp_avg_sq_row.numel() * exp_avg_sq_col.numel(),
                   "the moments' rows * cols");
}

inline void check_operands(const op_bindings::FactoredMoments& a, c10::DeviceType device) {
  check_moments(a.exp_avg_sq_row, a.exp_avg_sq_col, a.workspace, device);
}

inline void check_operands(const op_bindings::FactoredNorm& a, c10::DeviceType device) {
  check_moments(a.exp_avg_sq_row, a.exp_avg_sq_col, a.workspace, device);
  check_tile(a.grad, a.exp_avg_sq_row, a.exp_avg_sq_col, a.offset, device, "grad");
}

inline void check_operands(const op_bindings::FactoredApply& a, c10::DeviceType device) {
  check_moments(a.exp_avg_sq_row, a.exp_avg_sq_col, a.workspace, device);
  check_tile(a.param, a.exp_avg_sq_row, a.exp_avg_sq_col, a.offset, device, "param");
  check_with_grad(a.param, a.grad, device, "param");
}

// Passes A1 and C1 of a 1-D parameter.
template <class Vector>
void check_vector_operands(const Vector& a, c10::DeviceType device) {
  check_dense(a.param, device, "param");
  check_sized(a.grad, a.param.numel(), device, "grad", "param");
  check_fp32(a.exp_avg_sq, a.param.numel(), device, "exp_avg_sq");
  check_workspace(a.workspace, 0, device);
}

inline void check_operands(const op_bindings::VectorStats& a, c10::DeviceType device) {
  check_vector_operands(a, device);
}

inline void check_operands(const op_bindings::VectorApply& a, c10::DeviceType device) {
  check_vector_operands(a, device);
  TORCH_CHECK(a.full_numel > 0, "lomo_kernels: full_numel must be > 0, got ", a.full_numel);
  check_slice_fits(a.offset, a.param.numel(), a.full_numel, "full_numel");
}

}  // namespace binding
