// extern "C" launchers of the AdaLomo CUDA kernels (adalomo_cuda.cu). Plain C types only,
// so the kernels build with nvcc alone and any binding (adalomo_cuda_binding.cpp for torch)
// can call them. Every launcher enqueues exactly one kernel on `stream` and returns the
// cudaError_t of the launch (0 on success). Pointers are device pointers; optional ones may
// be NULL. Runtime scalars (lr, beta2, inv_scale, clip_coef) are pointers to one fp32 value,
// read by the kernels; a NULL lr or beta2 is refused with cudaErrorInvalidValue. Dtype codes:
// 0 fp32, 1 fp16, 2 bf16 (lomo::DtypeCode).
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "rounding_args.h"

#ifdef __cplusplus
extern "C" {
#endif

// How to turn a stored gradient value into the fp32 g of the math.
typedef struct {
  const float* inv_scale;  // NULL: 1
  int has_clip_value;      // clamp to [-clip_value, clip_value] when non-zero
  float clip_value;
  const float* clip_coef;  // NULL: 1
} AdalomoGradArgs;

// lr and the hyper-parameters of the final pass.
typedef struct {
  const float* lr;
  float eps1;
  float clip_threshold;
  float weight_decay;
} AdalomoStepArgs;

// Pass A: uses inv_scale and the clip value of grad_args and ignores clip_coef (the moments
// kernel applies it). grad and param hold the n flat elements [offset, offset + n) of the
// [rows, cols] matrix whose sums the workspace holds (offset 0, n = rows * cols: all of it).
int adalomo_cuda_factored_stats(const void* grad, int grad_dtype, const void* param,
                                int param_dtype, float* workspace, float* found_inf,
                                const float* skip_if, int64_t rows, int64_t cols,
                                int64_t offset, int64_t n, AdalomoGradArgs grad_args,
                                cudaStream_t stream);

// clip_coef: NULL for 1.
int adalomo_cuda_factored_moments(float* exp_avg_sq_row, float* exp_avg_sq_col,
                                  float* workspace, int64_t rows, int64_t cols,
                                  const float* beta2, const float* clip_coef, float eps0,
                                  cudaStream_t stream);

// Passes B and C: grad (and param) hold the n flat elements [offset, offset + n) of the
// [rows, cols] matrix of the moments (offset 0, n = rows * cols: all of it); the write-back's
// rms values are the matrix's and its rounding draws the bits of the flat index in it.
int adalomo_cuda_factored_norm(const void* grad, int grad_dtype, const float* exp_avg_sq_row,
                               const float* exp_avg_sq_col, float* workspace, int64_t rows,
                               int64_t cols, int64_t offset, int64_t n,
                               AdalomoGradArgs grad_args, cudaStream_t stream);

int adalomo_cuda_factored_apply(void* param, int param_dtype, const void* grad, int grad_dtype,
                                const float* exp_avg_sq_row, const float* exp_avg_sq_col,
                                const float* workspace, int64_t rows, int64_t cols,
                                int64_t offset, int64_t n, AdalomoStepArgs step,
                                AdalomoGradArgs grad_args, LomoRoundingArgs rounding,
                                cudaStream_t stream);

int adalomo_cuda_vector_stats(const void* grad, int grad_dtype, const void* param,
                              int param_dtype, const float* exp_avg_sq, float* workspace,
                              float* found_inf, const float* skip_if, int64_t n,
                              const float* beta2, float eps0, AdalomoGradArgs grad_args,
                              cudaStream_t stream);

// param, grad and v hold the n elements [offset, offset + n) of a vector of full_numel.
int adalomo_cuda_vector_apply(void* param, int param_dtype, const void* grad, int grad_dtype,
                              float* exp_avg_sq, const float* workspace, int64_t n,
                              int64_t offset, int64_t full_numel,
                              const float* beta2, float eps0, AdalomoStepArgs step,
                              AdalomoGradArgs grad_args, LomoRoundingArgs rounding,
                              cudaStream_t stream);

#ifdef __cplusplus
}
#endif
