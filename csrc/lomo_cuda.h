// extern "C" launchers of the LOMO CUDA kernels (lomo_cuda.cu). Plain C types only, so the
// kernels build with nvcc alone and any binding (lomo_cuda_binding.cpp for torch) can call
// them. Every launcher enqueues its kernel on `stream` and returns the cudaError_t of the
// launch (0 on success). Dtype codes: 0 fp32, 1 fp16, 2 bf16 (lomo::DtypeCode).
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Scalar pointers are device pointers to one fp32 value; inv_scale, clip_coef, skip_if and
// found_inf may be null (absent). clip_value: +inf when clipping by value is off.
// stochastic_rounding (non-zero) applies to bf16 and fp16 parameters, with the rounding key
// from the host's seed parts and a device pointer to one int64 per-step value (or null).
int lomo_cuda_update(void* param, int param_dtype, const void* grad,
                     int grad_dtype, int64_t numel, const float* lr,
                     const float* inv_scale, float clip_value,
                     const float* clip_coef, float weight_decay,
                     const float* skip_if, float* found_inf,
                     int stochastic_rounding, uint32_t seed_lo_mixed,
                     uint32_t seed_hi_salted, const int64_t* seed_step,
                     cudaStream_t stream);

int lomo_cuda_grad_sumsq(const void* grad, int grad_dtype, int64_t numel,
                         const float* inv_scale, float* sumsq, float* found_inf,
                         cudaStream_t stream);

#ifdef __cplusplus
}
#endif
