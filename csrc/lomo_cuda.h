// extern "C" launchers of the LOMO CUDA kernels (lomo_cuda.cu). Plain C types only, so the
// kernels build with nvcc alone and any binding (lomo_cuda_binding.cpp for torch) can call
// them. Every launcher enqueues its kernel on `stream` and returns the cudaError_t of the
// launch (0 on success). Dtype codes: 0 fp32, 1 fp16, 2 bf16 (lomo::DtypeCode).
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "rounding_args.h"

#ifdef __cplusplus
extern "C" {
#endif

// The update's scalars: pointers are device pointers to one fp32 value; inv_scale, clip_coef,
// skip_if and found_inf may be NULL (absent). The write-back rounds as `rounding` says.
typedef struct {
  const float* lr;
  const float* inv_scale;  // NULL: 1
  const float* clip_coef;  // NULL: 1
  float clip_value;        // +inf when clipping by value is off
  float weight_decay;
  const float* skip_if;
  float* found_inf;
  LomoRoundingArgs rounding;
} LomoUpdateArgs;

// The LOMO update of numel elements: a parameter, or the slice of one whose element 0 has flat
// index `offset` (>= 0) in it; the write-back's stochastic rounding draws the bits of flat
// index offset + j, as the whole parameter's would.
int lomo_cuda_update(void* param, int param_dtype, const void* grad, int grad_dtype,
                     int64_t numel, int64_t offset, LomoUpdateArgs args, cudaStream_t stream);

// The accumulation's arguments: first non-zero: the buffer's old contents are not read;
// inv_scale, sumsq and found_inf are device pointers to one fp32 value, each may be NULL
// (inv_scale absent: 1; sumsq and found_inf both absent: nothing is measured). The stored
// values round as `rounding` says.
typedef struct {
  int first;
  const float* inv_scale;
  float* sumsq;
  float* found_inf;
  LomoRoundingArgs rounding;
} GradAccumulateArgs;

int lomo_cuda_grad_sumsq(const void* grad, int grad_dtype, int64_t numel,
                         const float* inv_scale, float* sumsq, float* found_inf,
                         cudaStream_t stream);

// The accumulation into numel buffer elements, the slice at flat `offset` (>= 0) of its
// parameter's (0: the whole); stochastic rounding draws the bits of flat index offset + j.
int lomo_cuda_grad_accumulate(void* buffer, int buffer_dtype, const void* grad, int grad_dtype,
                              int64_t numel, int64_t offset, GradAccumulateArgs args,
                              cudaStream_t stream);

// An 8-bit blockwise buffer (lomo_kernels/core/int8_blocks.py): int8 codes, one per element,
// and fp32 power-of-two scales, one per 256-element block of the parameter's flat index that
// the buffer touches (int8_blocks.h: blocks_of); codes[0] is the parameter's flat element
// `offset` (>= 0). Device pointers; only the accumulation writes them.

typedef struct {
  int8_t* codes;
  float* scales;
  int64_t offset;
} LomoInt8Buffer;

// The accumulation into an 8-bit buffer of numel elements: `args` as grad_accumulate's, its
// rounding of the codes stochastic whenever asked (any gradient dtype), with the
// accumulation's stream at flat index offset + j.
int lomo_cuda_grad_accumulate_int8(LomoInt8Buffer buffer, const void* grad, int grad_dtype,
                                   int64_t numel, GradAccumulateArgs args, cudaStream_t stream);

// The LOMO update of numel parameter elements (a slice at the buffer's offset) with the
// gradient code * scale; the write-back's stochastic rounding (bf16, fp16) draws the bits of
// flat index offset + j.
int lomo_cuda_update_int8(void* param, int param_dtype, LomoInt8Buffer buffer, int64_t numel,
                          LomoUpdateArgs args, cudaStream_t stream);

// out = code * scale in out's dtype, numel elements.
int lomo_cuda_int8_dequantize(void* out, int out_dtype, LomoInt8Buffer buffer, int64_t numel,
                              cudaStream_t stream);

#ifdef __cplusplus
}
#endif
