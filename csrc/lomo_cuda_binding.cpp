// Torch binding of the CUDA launchers in lomo_cuda.cu (built only with a CUDA-enabled torch).
// Same Python-visible signatures as the CPU extension (lomo_cpu.cpp): the ops' specs.
#include <torch/extension.h>

// c10's stream header rather than ATen/cuda/CUDAContext.h: no cuBLAS/cuSPARSE headers needed.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "binding.h"
#include "lomo_cuda.h"
#include "op_bindings.h"

namespace {

using binding::OptTensor;
using binding::scalar_ptr;

void lomo_update_(const op_bindings::LomoUpdate& a) {
  binding::check_operands(a, c10::kCUDA);
  const c10::Device device = a.param.device();
  const c10::cuda::CUDAGuard guard(device);

  // Every block reads skip_if while any block may set found_inf: when they share storage a
  // late block could see an early block's write and skip half the tensor. Snapshot it.
  OptTensor skip = a.skip_if;
  if (skip.has_value() && a.found_inf.has_value() && skip->is_alias_of(*a.found_inf)) {
    skip = skip->clone();
  }
  LomoUpdateArgs args;
  args.lr = scalar_ptr(a.lr, device, "lr");
  args.inv_scale = scalar_ptr(a.grad_args.inv_scale, device, "inv_scale");
  args.clip_value = binding::clip_bound(a.grad_args.clip_value);
  args.clip_coef = scalar_ptr(a.grad_args.clip_coef, device, "clip_coef");
  args.weight_decay = static_cast<float>(a.weight_decay);
  args.skip_if = scalar_ptr(skip, device, "skip_if");
  args.found_inf = scalar_ptr(a.found_inf, device, "found_inf");
  args.rounding = binding::rounding_args(a.param, a.rounding);
  const int rc = lomo_cuda_update(a.param.data_ptr(), binding::dtype_code(a.param, "param"),
                                  a.grad.const_data_ptr(), binding::dtype_code(a.grad, "grad"),
                                  a.param.numel(), args,
                                  c10::cuda::getCurrentCUDAStream().stream());
  C10_CUDA_CHECK(static_cast<cudaError_t>(rc));
  binding::bump_version(a.param);
  if (a.found_inf.has_value()) binding::bump_version(*a.found_inf);
}

void grad_sumsq_(const op_bindings::GradSumsq& a) {
  binding::check_dense(a.grad, c10::kCUDA, "grad");
  const c10::Device device = a.grad.device();
  const c10::cuda::CUDAGuard guard(device);
  const int rc = lomo_cuda_grad_sumsq(
      a.grad.const_data_ptr(), binding::dtype_code(a.grad, "grad"), a.grad.numel(),
      scalar_ptr(a.inv_scale, device, "inv_scale"), scalar_ptr(a.sumsq, device, "sumsq"),
      scalar_ptr(a.found_inf, device, "found_inf"), c10::cuda::getCurrentCUDAStream().stream());
  C10_CUDA_CHECK(static_cast<cudaError_t>(rc));
  binding::bump_version(a.sumsq);
  if (a.found_inf.has_value()) binding::bump_version(*a.found_inf);
}

void grad_accumulate_(const op_bindings::GradAccumulate& a) {
  binding::check_operands(a, c10::kCUDA);
  const c10::Device device = a.buffer.device();
  const c10::cuda::CUDAGuard guard(device);
  GradAccumulateArgs args;
  args.first = a.first ? 1 : 0;
  args.inv_scale = scalar_ptr(a.inv_scale, device, "inv_scale");
  args.sumsq = scalar_ptr(a.sumsq, device, "sumsq");
  args.found_inf = scalar_ptr(a.found_inf, device, "found_inf");
  args.rounding = binding::rounding_args(a.buffer, a.rounding);
  const int rc = lomo_cuda_grad_accumulate(
      a.buffer.data_ptr(), binding::dtype_code(a.buffer, "buffer"), a.grad.const_data_ptr(),
      binding::dtype_code(a.grad, "grad"), a.buffer.numel(), args,
      c10::cuda::getCurrentCUDAStream().stream());
  C10_CUDA_CHECK(static_cast<cudaError_t>(rc));
  binding::bump_version(a.buffer);
  if (a.sumsq.has_value()) binding::bump_version(*a.sumsq);
  if (a.found_inf.has_value()) binding::bump_version(*a.found_inf);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lomo_kernels CUDA kernels";
  op_bindings::def_lomo_ops(m, &lomo_update_, &grad_sumsq_, &grad_accumulate_);
}
