// Torch binding of the CUDA launchers in lomo_cuda.cu (built only with a CUDA-enabled torch).
// Same Python-visible signatures as the CPU extension (lomo_cpu.cpp): the ops' specs.
#include <torch/extension.h>

// c10's stream header rather than ATen/cuda/CUDAContext.h: no cuBLAS/cuSPARSE headers needed.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <limits>
#include <optional>

#include "binding.h"
#include "op_bindings.h"
#include "lomo_cuda.h"
#include "lomo_math.h"

namespace {

using binding::OptTensor;
using binding::scalar_ptr;

void lomo_update_(at::Tensor param, const at::Tensor& grad, const at::Tensor& lr,
                  const OptTensor& inv_scale, std::optional<double> clip_value,
                  const OptTensor& clip_coef, double weight_decay, const OptTensor& found_inf,
                  const OptTensor& skip_if, bool stochastic_rounding, uint64_t seed,
                  const OptTensor& seed_step) {
  binding::check_dense(param, c10::kCUDA, "param");
  binding::check_dense(grad, c10::kCUDA, "grad");
  TORCH_CHECK(grad.device() == param.device() && param.numel() == grad.numel(),
              "lomo_kernels: param and grad must be on one device with the same numel");
  const c10::Device device = param.device();
  const c10::cuda::CUDAGuard guard(device);

  // Every block reads skip_if while any block may set found_inf: when they share storage a
  // late block could see an early block's write and skip half the tensor. Snapshot it.
  OptTensor skip = skip_if;
  if (skip.has_value() && found_inf.has_value() && skip->is_alias_of(*found_inf)) {
    skip = skip->clone();
  }
  // Stochastic rounding applies to the low-precision parameters (bf16, fp16).
  const bool stochastic =
      stochastic_rounding &&
      (param.scalar_type() == at::kBFloat16 || param.scalar_type() == at::kHalf);

  const int rc = lomo_cuda_update(
      param.data_ptr(), binding::dtype_code(param, "param"), grad.const_data_ptr(),
      binding::dtype_code(grad, "grad"), param.numel(), scalar_ptr(lr, device, "lr"),
      scalar_ptr(inv_scale, device, "inv_scale"),
      clip_value.has_value() ? static_cast<float>(*clip_value)
                             : std::numeric_limits<float>::infinity(),
      scalar_ptr(clip_coef, device, "clip_coef"), static_cast<float>(weight_decay),
      scalar_ptr(skip, device, "skip_if"), scalar_ptr(found_inf, device, "found_inf"),
      stochastic ? 1 : 0, lomo::seed_lo_mixed(seed), lomo::seed_hi_salted(seed),
      stochastic ? binding::seed_step_ptr(seed_step, device) : nullptr,
      c10::cuda::getCurrentCUDAStream().stream());
  C10_CUDA_CHECK(static_cast<cudaError_t>(rc));
  binding::bump_version(param);
  if (found_inf.has_value()) binding::bump_version(*found_inf);
}

void grad_sumsq_(const at::Tensor& grad, const OptTensor& inv_scale, at::Tensor sumsq,
                 const OptTensor& found_inf) {
  binding::check_dense(grad, c10::kCUDA, "grad");
  const c10::Device device = grad.device();
  const c10::cuda::CUDAGuard guard(device);
  const int rc = lomo_cuda_grad_sumsq(
      grad.const_data_ptr(), binding::dtype_code(grad, "grad"), grad.numel(),
      scalar_ptr(inv_scale, device, "inv_scale"), scalar_ptr(sumsq, device, "sumsq"),
      scalar_ptr(found_inf, device, "found_inf"), c10::cuda::getCurrentCUDAStream().stream());
  C10_CUDA_CHECK(static_cast<cudaError_t>(rc));
  binding::bump_version(sumsq);
  if (found_inf.has_value()) binding::bump_version(*found_inf);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lomo_kernels CUDA kernels";
  op_bindings::def_lomo_ops(m, &lomo_update_, &grad_sumsq_);
}
