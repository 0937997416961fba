// torch binding of the AdaLomo CUDA launchers (adalomo_cuda.h). Built only with a CUDA torch,
// by lomo_kernels/ops/adalomo/cpp_backend.py; the functions take the arguments of the CPU
// extension (adalomo_cpu.cpp), declared once in op_bindings.h, so the backend calls either the
// same way. Nothing here reads a device value: the scalar tensors (1-element fp32 on the
// parameter's device) are passed to the kernels as device pointers.
#include <torch/extension.h>

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include "adalomo_cuda.h"
#include "binding.h"
#include "op_bindings.h"

namespace {

using binding::dtype_code;
using binding::scalar_ptr;

float* ptr(const at::Tensor& t) { return t.data_ptr<float>(); }

AdalomoGradArgs grad_args(const at::Tensor& like, const op_bindings::GradArgs& a) {
  AdalomoGradArgs out;
  out.inv_scale = scalar_ptr(a.inv_scale, like.device(), "inv_scale");
  out.has_clip_value = a.clip_value.has_value() ? 1 : 0;
  out.clip_value = a.clip_value.has_value() ? static_cast<float>(*a.clip_value) : 0.0f;
  out.clip_coef = scalar_ptr(a.clip_coef, like.device(), "clip_coef");
  return out;
}

AdalomoStepArgs step_args(const at::Tensor& like, const op_bindings::StepArgs& a) {
  AdalomoStepArgs out;
  out.lr = scalar_ptr(a.lr, like.device(), "lr");
  out.eps1 = static_cast<float>(a.eps1);
  out.clip_threshold = static_cast<float>(a.clip_threshold);
  out.weight_decay = static_cast<float>(a.weight_decay);
  return out;
}

void check_launch(int status) {
  TORCH_CHECK(status == 0, "lomo_kernels: AdaLomo CUDA launch failed: ",
              cudaGetErrorString(static_cast<cudaError_t>(status)));
}

cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream(); }

void factored_stats_(const op_bindings::FactoredStats& a) {
  binding::check_operands(a, c10::kCUDA);
  const int64_t rows = binding::factored_rows(a.workspace, a.cols);
  const c10::Device device = a.param.device();
  const c10::cuda::CUDAGuard guard(device);
  check_launch(adalomo_cuda_factored_stats(
      a.grad.const_data_ptr(), dtype_code(a.grad, "grad"), a.param.const_data_ptr(),
      dtype_code(a.param, "param"), ptr(a.workspace), scalar_ptr(a.found_inf, device, "found_inf"),
      scalar_ptr(a.skip_if, device, "skip_if"), rows, a.cols, a.offset, a.grad.numel(),
      grad_args(a.param, a.grad_args), current_stream()));
}

void factored_moments_(const op_bindings::FactoredMoments& a) {
  binding::check_operands(a, c10::kCUDA);
  // No parameter here: the moments' device stands for it.
  const c10::Device device = a.exp_avg_sq_row.device();
  const c10::cuda::CUDAGuard guard(a.workspace.device());
  check_launch(adalomo_cuda_factored_moments(
      ptr(a.exp_avg_sq_row), ptr(a.exp_avg_sq_col), ptr(a.workspace), a.exp_avg_sq_row.numel(),
      a.exp_avg_sq_col.numel(), scalar_ptr(a.beta2, device, "beta2"),
      scalar_ptr(a.clip_coef, device, "clip_coef"), static_cast<float>(a.eps0),
      current_stream()));
}

void factored_norm_(const op_bindings::FactoredNorm& a) {
  binding::check_operands(a, c10::kCUDA);
  const c10::cuda::CUDAGuard guard(a.grad.device());
  check_launch(adalomo_cuda_factored_norm(
      a.grad.const_data_ptr(), dtype_code(a.grad, "grad"), ptr(a.exp_avg_sq_row),
      ptr(a.exp_avg_sq_col), ptr(a.workspace), a.exp_avg_sq_row.numel(),
      a.exp_avg_sq_col.numel(), a.offset, a.grad.numel(), grad_args(a.grad, a.grad_args),
      current_stream()));
}

void factored_apply_(const op_bindings::FactoredApply& a) {
  binding::check_operands(a, c10::kCUDA);
  const c10::cuda::CUDAGuard guard(a.param.device());
  check_launch(adalomo_cuda_factored_apply(
      a.param.data_ptr(), dtype_code(a.param, "param"), a.grad.const_data_ptr(),
      dtype_code(a.grad, "grad"), ptr(a.exp_avg_sq_row), ptr(a.exp_avg_sq_col),
      ptr(a.workspace), a.exp_avg_sq_row.numel(), a.exp_avg_sq_col.numel(), a.offset,
      a.param.numel(), step_args(a.param, a.step), grad_args(a.param, a.grad_args),
      binding::rounding_args(a.param, a.rounding), current_stream()));
}

void vector_stats_(const op_bindings::VectorStats& a) {
  binding::check_operands(a, c10::kCUDA);
  const c10::Device device = a.param.device();
  const c10::cuda::CUDAGuard guard(device);
  check_launch(adalomo_cuda_vector_stats(
      a.grad.const_data_ptr(), dtype_code(a.grad, "grad"), a.param.const_data_ptr(),
      dtype_code(a.param, "param"), ptr(a.exp_avg_sq), ptr(a.workspace),
      scalar_ptr(a.found_inf, device, "found_inf"), scalar_ptr(a.skip_if, device, "skip_if"),
      a.param.numel(), scalar_ptr(a.beta2, device, "beta2"), static_cast<float>(a.eps0),
      grad_args(a.param, a.grad_args), current_stream()));
}

void vector_apply_(const op_bindings::VectorApply& a) {
  binding::check_operands(a, c10::kCUDA);
  const c10::Device device = a.param.device();
  const c10::cuda::CUDAGuard guard(device);
  check_launch(adalomo_cuda_vector_apply(
      a.param.data_ptr(), dtype_code(a.param, "param"), a.grad.const_data_ptr(),
      dtype_code(a.grad, "grad"), ptr(a.exp_avg_sq), ptr(a.workspace), a.param.numel(),
      a.offset, a.full_numel, scalar_ptr(a.beta2, device, "beta2"),
      static_cast<float>(a.eps0), step_args(a.param, a.step), grad_args(a.param, a.grad_args),
      binding::rounding_args(a.param, a.rounding), current_stream()));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lomo_kernels AdaLomo CUDA kernels";
  op_bindings::def_adalomo_ops(m, {&factored_stats_, &factored_moments_, &factored_norm_,
                                  &factored_apply_, &vector_stats_, &vector_apply_});
}
