// Torch binding of the CUDA launchers in lomo_cuda.cu (built only with a CUDA-enabled torch).
// Same Python-visible signatures as the CPU extension (lomo_cpu.cpp): the ops' specs.
#include <torch/extension.h>

// c10's stream header rather than ATen/cuda/CUDAContext.h: no cuBLAS/cuSPARSE headers needed.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "binding.h"
#include "int8_blocks.h"
#include "lomo_cuda.h"
#include "op_bindings.h"

namespace {

using binding::OptTensor;
using binding::scalar_ptr;

// skip_if as the kernel reads it. Every block reads skip_if while any block may set found_inf:
// when they share storage a late block could see an early block's write and skip half the
// tensor. Snapshot it then.
OptTensor skip_snapshot(const OptTensor& skip_if, const OptTensor& found_inf) {
  if (skip_if.has_value() && found_inf.has_value() && skip_if->is_alias_of(*found_inf)) {
    return skip_if->clone();
  }
  return skip_if;
}

// The update's scalars and rounding as the launchers take them, from the arguments of
// lomo_update_ or lomo_update_int8_ (`skip`: their skip_snapshot, alive until the launch).
template <class Update>
LomoUpdateArgs update_args(const Update& a, const OptTensor& skip) {
  const c10::Device device = a.param.device();
  LomoUpdateArgs args;
  args.lr = scalar_ptr(a.lr, device, "lr");
  args.inv_scale = scalar_ptr(a.grad_args.inv_scale, device, "inv_scale");
  args.clip_value = binding::clip_bound(a.grad_args.clip_value);
  args.clip_coef = scalar_ptr(a.grad_args.clip_coef, device, "clip_coef");
  args.weight_decay = static_cast<float>(a.weight_decay);
  args.skip_if = scalar_ptr(skip, device, "skip_if");
  args.found_inf = scalar_ptr(a.found_inf, device, "found_inf");
  args.rounding = binding::rounding_args(a.param, a.rounding);
  return args;
}

// The accumulation's arguments from those of grad_accumulate_ or grad_accumulate_int8_, the
// stored values rounding as `rounding` says.
template <class Accumulate>
GradAccumulateArgs accumulate_args(const Accumulate& a, LomoRoundingArgs rounding) {
  const c10::Device device = a.grad.device();
  GradAccumulateArgs args;
  args.first = a.first ? 1 : 0;
  args.inv_scale = scalar_ptr(a.inv_scale, device, "inv_scale");
  args.sumsq = scalar_ptr(a.sumsq, device, "sumsq");
  args.found_inf = scalar_ptr(a.found_inf, device, "found_inf");
  args.rounding = rounding;
  return args;
}

void lomo_update_(const op_bindings::LomoUpdate& a) {
  binding::check_operands(a, c10::kCUDA);
  const c10::cuda::CUDAGuard guard(a.param.device());
  const OptTensor skip = skip_snapshot(a.skip_if, a.found_inf);
  const int rc = lomo_cuda_update(a.param.data_ptr(), binding::dtype_code(a.param, "param"),
                                  a.grad.const_data_ptr(), binding::dtype_code(a.grad, "grad"),
                                  a.param.numel(), a.offset, update_args(a, skip),
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
  const c10::cuda::CUDAGuard guard(a.buffer.device());
  const GradAccumulateArgs args =
      accumulate_args(a, binding::rounding_args(a.buffer, a.rounding));
  const int rc = lomo_cuda_grad_accumulate(
      a.buffer.data_ptr(), binding::dtype_code(a.buffer, "buffer"), a.grad.const_data_ptr(),
      binding::dtype_code(a.grad, "grad"), a.buffer.numel(), a.offset, args,
      c10::cuda::getCurrentCUDAStream().stream());
  C10_CUDA_CHECK(static_cast<cudaError_t>(rc));
  binding::bump_version(a.buffer);
  if (a.sumsq.has_value()) binding::bump_version(*a.sumsq);
  if (a.found_inf.has_value()) binding::bump_version(*a.found_inf);
}

// ----------------------------------------------------------------------------- 8-bit buffer

// The buffer of `data`'s elements (param, grad, out), checked (binding::check_int8_buffer).
LomoInt8Buffer int8_buffer(const op_bindings::Int8Buffer& b, const at::Tensor& data) {
  binding::check_int8_buffer(b, data, c10::kCUDA);
  return {static_cast<int8_t*>(b.codes.data_ptr()), static_cast<float*>(b.scales.data_ptr()),
          b.offset};
}

// The codes' rounding: stochastic whenever asked (the codes are never exact), its key from the
// seed and the device's seed_step.
LomoRoundingArgs code_rounding(const op_bindings::RoundingArgs& a, c10::Device device) {
  LomoRoundingArgs out;
  out.stochastic = a.stochastic_rounding ? 1 : 0;
  out.seed_lo_mixed = lomo::seed_lo_mixed(a.seed);
  out.seed_hi_salted = lomo::seed_hi_salted(a.seed);
  out.seed_step = a.stochastic_rounding ? binding::seed_step_ptr(a.seed_step, device) : nullptr;
  return out;
}

void grad_accumulate_int8_(const op_bindings::GradAccumulateInt8& a) {
  binding::check_dense(a.grad, c10::kCUDA, "grad");
  const c10::Device device = a.grad.device();
  const c10::cuda::CUDAGuard guard(device);
  const LomoInt8Buffer buffer = int8_buffer(a.buffer, a.grad);
  const GradAccumulateArgs args = accumulate_args(a, code_rounding(a.rounding, device));
  const int rc = lomo_cuda_grad_accumulate_int8(buffer, a.grad.const_data_ptr(),
                                                binding::dtype_code(a.grad, "grad"),
                                                a.grad.numel(), args,
                                                c10::cuda::getCurrentCUDAStream().stream());
  C10_CUDA_CHECK(static_cast<cudaError_t>(rc));
  binding::bump_version(a.buffer.codes);
  binding::bump_version(a.buffer.scales);
  if (a.sumsq.has_value()) binding::bump_version(*a.sumsq);
  if (a.found_inf.has_value()) binding::bump_version(*a.found_inf);
}

void lomo_update_int8_(const op_bindings::LomoUpdateInt8& a) {
  binding::check_dense(a.param, c10::kCUDA, "param");
  const c10::cuda::CUDAGuard guard(a.param.device());
  const LomoInt8Buffer buffer = int8_buffer(a.buffer, a.param);
  const OptTensor skip = skip_snapshot(a.skip_if, a.found_inf);
  const int rc = lomo_cuda_update_int8(a.param.data_ptr(), binding::dtype_code(a.param, "param"),
                                       buffer, a.param.numel(), update_args(a, skip),
                                       c10::cuda::getCurrentCUDAStream().stream());
  C10_CUDA_CHECK(static_cast<cudaError_t>(rc));
  binding::bump_version(a.param);
  if (a.found_inf.has_value()) binding::bump_version(*a.found_inf);
}

void int8_dequantize_(const op_bindings::Int8Dequantize& a) {
  binding::check_dense(a.out, c10::kCUDA, "out");
  const c10::cuda::CUDAGuard guard(a.out.device());
  const LomoInt8Buffer buffer = int8_buffer(a.buffer, a.out);
  const int rc = lomo_cuda_int8_dequantize(a.out.data_ptr(), binding::dtype_code(a.out, "out"),
                                           buffer, a.out.numel(),
                                           c10::cuda::getCurrentCUDAStream().stream());
  C10_CUDA_CHECK(static_cast<cudaError_t>(rc));
  binding::bump_version(a.out);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lomo_kernels CUDA kernels";
  op_bindings::def_lomo_ops(m, {&lomo_update_, &grad_sumsq_, &grad_accumulate_,
                               &grad_accumulate_int8_, &lomo_update_int8_, &int8_dequantize_});
}
