// What both CUDA sources (lomo_cuda.cu, adalomo_cuda.cu) share: the grid of a grid-stride
// launch, a warp's sum, and the rounding key finished on the device. nvcc only, no torch.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include <atomic>

#include "lomo_math.h"
#include "rounding_args.h"

namespace cuda_common {

// Multiprocessors of the current device, asked once per device. 80 when the runtime cannot
// say: the launch that follows then reports its error.
inline int sm_count() {
  static std::atomic<int> cached[64];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 80;
  if (device >= 0 && device < 64) {
    const int known = cached[device].load(std::memory_order_relaxed);
    if (known > 0) return known;
  }
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      sms <= 0) {
    sms = 80;
  }
  if (device >= 0 && device < 64) cached[device].store(sms, std::memory_order_relaxed);
  return sms;
}

// Blocks of a grid-stride launch over `work_items` (one per thread per step): enough for all of
// them, at most `blocks_per_sm` resident per multiprocessor (the loop covers the rest), at
// least one.
inline unsigned grid_for(int64_t work_items, int threads, int blocks_per_sm) {
  const int64_t wanted = (work_items + threads - 1) / threads;
  const int64_t cap = static_cast<int64_t>(sm_count()) * blocks_per_sm;
  return static_cast<unsigned>(wanted < 1 ? 1 : (wanted < cap ? wanted : cap));
}

// The sum over the warp, in every lane (lane 0 adds in the order of a tree from the lanes 16
// apart down to neighbours).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, offset);
  return v;
}

// The stochastic-rounding key, finished on the device with the per-step value (its low 32
// bits), so the host never reads it.
__device__ __forceinline__ uint32_t rounding_key(const LomoRoundingArgs& r) {
  const uint32_t step = r.seed_step != nullptr ? static_cast<uint32_t>(*r.seed_step) : 0u;
  return lomo::rounding_key(r.seed_lo_mixed, r.seed_hi_salted, step);
}

}  // namespace cuda_common
