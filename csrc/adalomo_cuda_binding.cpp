// torch binding of the AdaLomo CUDA launchers (adalomo_cuda.h). Built only with a CUDA torch,
// by lomo_kernels/kernels/cpp/adalomo.py; the functions have the signatures of the CPU
// extension (adalomo_cpu.cpp) so the backend calls either the same way. Nothing here reads
// a device value: the scalar tensors (1-element fp32 on the parameter's device) are passed
// to the kernels as device pointers.
#include <torch/extension.h>

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <optional>

#include "adalomo_cuda.h"
#include "adalomo_math.h"
#include "binding.h"
#include "op_bindings.h"

namespace {

using binding::OptTensor;
using binding::dtype_code;
using binding::scalar_ptr;

float* ptr(const at::Tensor& t) { return t.data_ptr<float>(); }

AdalomoGradArgs grad_args(const at::Tensor& like, const OptTensor& inv_scale,
                          std::optional<double> clip_value, const OptTensor& clip_coef) {
  AdalomoGradArgs a;
  a.inv_scale = scalar_ptr(inv_scale, like.device(), "inv_scale");
  a.has_clip_value = clip_value.has_value() ? 1 : 0;
  a.clip_value = clip_value.has_value() ? static_cast<float>(*clip_value) : 0.0f;
  a.clip_coef = scalar_ptr(clip_coef, like.device(), "clip_coef");
  return a;
}

AdalomoStepArgs step_args(const at::Tensor& like, const at::Tensor& lr, double eps1,
                          double clip_threshold, double weight_decay) {
  AdalomoStepArgs a;
  a.lr = scalar_ptr(lr, like.device(), "lr");
  a.eps1 = static_cast<float>(eps1);
  a.clip_threshold = static_cast<float>(clip_threshold);
  a.weight_decay = static_cast<float>(weight_decay);
  return a;
}

// The write-back's rounding: stochastic for bf16 and fp16 parameters when asked, the key
// finished on the device from seed_step (checked only then), as lomo_cuda_binding.cpp does.
AdalomoRoundingArgs rounding_args(const at::Tensor& param, bool stochastic_rounding,
                                  uint64_t seed, const OptTensor& seed_step) {
  const at::ScalarType type = param.scalar_type();
  AdalomoRoundingArgs a;
  a.stochastic = stochastic_rounding && (type == at::kBFloat16 || type == at::kHalf) ? 1 : 0;
  a.seed_lo_mixed = lomo::seed_lo_mixed(seed);
  a.seed_hi_salted = lomo::seed_hi_salted(seed);
  a.seed_step = a.stochastic != 0 ? binding::seed_step_ptr(seed_step, param.device()) : nullptr;
  return a;
}

void check_launch(int status) {
  TORCH_CHECK(status == 0, "lomo_kernels: AdaLomo CUDA launch failed: ",
              cudaGetErrorString(static_cast<cudaError_t>(status)));
}

void factored_stats_(const at::Tensor& grad, const at::Tensor& param, at::Tensor workspace,
                     const OptTensor& found_inf, const OptTensor& skip_if, int64_t cols,
                     const OptTensor& inv_scale, std::optional<double> clip_value) {
  const int64_t rows = binding::check_adalomo_stats(grad, param, workspace, cols, c10::kCUDA);
  const c10::cuda::CUDAGuard guard(param.device());
  check_launch(adalomo_cuda_factored_stats(
      grad.const_data_ptr(), dtype_code(grad, "grad"), param.const_data_ptr(),
      dtype_code(param, "param"), ptr(workspace), scalar_ptr(found_inf, param.device(), "found_inf"),
      scalar_ptr(skip_if, param.device(), "skip_if"), rows, cols,
      grad_args(param, inv_scale, clip_value, std::nullopt), c10::cuda::getCurrentCUDAStream()));
}

void factored_moments_(at::Tensor exp_avg_sq_row, at::Tensor exp_avg_sq_col,
                       at::Tensor workspace, const at::Tensor& beta2,
                       const OptTensor& clip_coef, double eps0) {
  const int64_t rows = exp_avg_sq_row.numel(), cols = exp_avg_sq_col.numel();
  binding::check_adalomo_moments(exp_avg_sq_row, exp_avg_sq_col, workspace, c10::kCUDA);
  const c10::cuda::CUDAGuard guard(workspace.device());
  // No parameter here: the moments' device stands for it.
  check_launch(adalomo_cuda_factored_moments(
      ptr(exp_avg_sq_row), ptr(exp_avg_sq_col), ptr(workspace), rows, cols,
      scalar_ptr(beta2, exp_avg_sq_row.device(), "beta2"), scalar_ptr(clip_coef, exp_avg_sq_row.device(), "clip_coef"),
      static_cast<float>(eps0), c10::cuda::getCurrentCUDAStream()));
}

void factored_norm_(const at::Tensor& grad, const at::Tensor& exp_avg_sq_row,
                    const at::Tensor& exp_avg_sq_col, at::Tensor workspace,
                    const OptTensor& inv_scale, std::optional<double> clip_value,
                    const OptTensor& clip_coef) {
  const int64_t rows = exp_avg_sq_row.numel(), cols = exp_avg_sq_col.numel();
  binding::check_adalomo_moments(exp_avg_sq_row, exp_avg_sq_col, workspace, c10::kCUDA);
  binding::check_adalomo_tile(grad, exp_avg_sq_row, exp_avg_sq_col, c10::kCUDA, "grad");
  const c10::cuda::CUDAGuard guard(grad.device());
  check_launch(adalomo_cuda_factored_norm(
      grad.const_data_ptr(), dtype_code(grad, "grad"), ptr(exp_avg_sq_row),
      ptr(exp_avg_sq_col), ptr(workspace), rows, cols,
      grad_args(grad, inv_scale, clip_value, clip_coef), c10::cuda::getCurrentCUDAStream()));
}

void factored_apply_(at::Tensor param, const at::Tensor& grad, const at::Tensor& exp_avg_sq_row,
                     const at::Tensor& exp_avg_sq_col, at::Tensor workspace,
                     const at::Tensor& lr, double eps1, double clip_threshold,
                     double weight_decay, const OptTensor& inv_scale,
                     std::optional<double> clip_value, const OptTensor& clip_coef,
                     bool stochastic_rounding, uint64_t seed, const OptTensor& seed_step) {
  const int64_t rows = exp_avg_sq_row.numel(), cols = exp_avg_sq_col.numel();
  binding::check_adalomo_moments(exp_avg_sq_row, exp_avg_sq_col, workspace, c10::kCUDA);
  binding::check_adalomo_tile(param, exp_avg_sq_row, exp_avg_sq_col, c10::kCUDA, "param");
  binding::check_adalomo_tile(grad, exp_avg_sq_row, exp_avg_sq_col, c10::kCUDA, "grad");
  const c10::cuda::CUDAGuard guard(param.device());
  check_launch(adalomo_cuda_factored_apply(
      param.data_ptr(), dtype_code(param, "param"), grad.const_data_ptr(),
      dtype_code(grad, "grad"), ptr(exp_avg_sq_row), ptr(exp_avg_sq_col), ptr(workspace), rows,
      cols, step_args(param, lr, eps1, clip_threshold, weight_decay),
      grad_args(param, inv_scale, clip_value, clip_coef),
      rounding_args(param, stochastic_rounding, seed, seed_step),
      c10::cuda::getCurrentCUDAStream()));
}

void vector_stats_(const at::Tensor& grad, const at::Tensor& param,
                   const at::Tensor& exp_avg_sq, at::Tensor workspace,
                   const OptTensor& found_inf, const OptTensor& skip_if,
                   const at::Tensor& beta2, double eps0, const OptTensor& inv_scale,
                   std::optional<double> clip_value, const OptTensor& clip_coef) {
  const int64_t n = param.numel();
  binding::check_adalomo_vector(grad, param, exp_avg_sq, workspace, c10::kCUDA);
  const c10::cuda::CUDAGuard guard(param.device());
  check_launch(adalomo_cuda_vector_stats(
      grad.const_data_ptr(), dtype_code(grad, "grad"), param.const_data_ptr(),
      dtype_code(param, "param"), ptr(exp_avg_sq), ptr(workspace),
      scalar_ptr(found_inf, param.device(), "found_inf"), scalar_ptr(skip_if, param.device(), "skip_if"), n,
      scalar_ptr(beta2, param.device(), "beta2"), static_cast<float>(eps0),
      grad_args(param, inv_scale, clip_value, clip_coef), c10::cuda::getCurrentCUDAStream()));
}

void vector_apply_(at::Tensor param, const at::Tensor& grad, at::Tensor exp_avg_sq,
                   at::Tensor workspace, const at::Tensor& beta2, double eps0,
                   const at::Tensor& lr, double eps1, double clip_threshold,
                   double weight_decay, const OptTensor& inv_scale,
                   std::optional<double> clip_value, const OptTensor& clip_coef,
                   bool stochastic_rounding, uint64_t seed, const OptTensor& seed_step) {
  const int64_t n = param.numel();
  binding::check_adalomo_vector(grad, param, exp_avg_sq, workspace, c10::kCUDA);
  const c10::cuda::CUDAGuard guard(param.device());
  check_launch(adalomo_cuda_vector_apply(
      param.data_ptr(), dtype_code(param, "param"), grad.const_data_ptr(),
      dtype_code(grad, "grad"), ptr(exp_avg_sq), ptr(workspace), n,
      scalar_ptr(beta2, param.device(), "beta2"), static_cast<float>(eps0),
      step_args(param, lr, eps1, clip_threshold, weight_decay),
      grad_args(param, inv_scale, clip_value, clip_coef),
      rounding_args(param, stochastic_rounding, seed, seed_step),
      c10::cuda::getCurrentCUDAStream()));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lomo_kernels AdaLomo CUDA kernels";
  op_bindings::def_adalomo_ops(m, &factored_stats_, &factored_moments_, &factored_norm_,
                               &factored_apply_, &vector_stats_, &vector_apply_);
}
