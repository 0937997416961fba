// CUDA kernels of the fused LOMO update and the gradient sum of squares, with extern "C"
// launchers on raw pointers. No torch headers: `nvcc -std=c++17 -arch=sm_90 -c` builds it
// alone; lomo_cuda_binding.cpp is the torch side. Semantics: lomo_kernels/ops/lomo_reference.py.
//
// Layout of one launch: a scalar head (elements before both pointers are 16-byte aligned),
// an aligned bulk moved with 128-bit loads/stores (V elements per thread and step), and a
// scalar tail. Grid-stride loops with int64 indices; skip_if and the runtime scalars (lr,
// inv_scale, clip_coef: 1-element fp32 tensors; the rounding seed's per-step value, an int64)
// are read on the device through pointers, so the host never synchronises.
#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdint>

#include "lomo_cuda.h"
#include "lomo_math.h"

namespace {

constexpr int kThreads = 256;
// Enough resident blocks to hide latency; the grid-stride loop covers the rest.
constexpr int kBlocksPerSm = 8;

// Device pointers to the runtime scalars and the host-side hyper-parameters.
struct UpdateArgs {
  const float* lr;
  const float* inv_scale;  // nullptr: 1
  const float* clip_coef;  // nullptr: 1
  float clip;              // +inf when clipping by value is off
  float weight_decay;
  const float* skip_if;
  float* found_inf;
  uint32_t seed_lo_mixed;   // the host's share of the rounding key (_rounding.seed_parts)
  uint32_t seed_hi_salted;
  const int64_t* seed_step;  // nullptr: no per-step value
};

// The reference's fp32 arithmetic on the scalars.
__device__ __forceinline__ lomo::LomoScalars resolve(const UpdateArgs& a) {
  lomo::LomoScalars s;
  s.lr = __ldg(a.lr);
  s.decay = __fsub_rn(1.0f, __fmul_rn(s.lr, a.weight_decay));
  s.inv_scale = a.inv_scale != nullptr ? __ldg(a.inv_scale) : 1.0f;
  s.clip = a.clip;
  s.coef = a.clip_coef != nullptr ? __ldg(a.clip_coef) : 1.0f;
  return s;
}

// The stochastic-rounding key, finished on the device with the per-step value (its low 32
// bits), so the host never reads it.
__device__ __forceinline__ uint32_t rounding_key(const UpdateArgs& a) {
  const uint32_t step = a.seed_step != nullptr ? static_cast<uint32_t>(__ldg(a.seed_step)) : 0u;
  return lomo::rounding_key(a.seed_lo_mixed, a.seed_hi_salted, step);
}

// V elements of storage type T in registers, viewed as 128-bit words for the memory ops.
template <class T, int V>
union Vec {
  static constexpr int kWords = V * static_cast<int>(sizeof(T)) / 16;
  uint4 words[kWords];
  T e[V];
};

template <class T, int V>
__device__ __forceinline__ void load_vec(Vec<T, V>& v, const T* base) {
  const uint4* src = reinterpret_cast<const uint4*>(base);
#pragma unroll
  for (int w = 0; w < Vec<T, V>::kWords; ++w) v.words[w] = src[w];
}

// Read-only operand: the non-coherent path (ld.global.nc).
template <class T, int V>
__device__ __forceinline__ void load_vec_ro(Vec<T, V>& v, const T* base) {
  const uint4* src = reinterpret_cast<const uint4*>(base);
#pragma unroll
  for (int w = 0; w < Vec<T, V>::kWords; ++w) v.words[w] = __ldg(src + w);
}

template <class T, int V>
__device__ __forceinline__ void store_vec(const Vec<T, V>& v, T* base) {
  uint4* dst = reinterpret_cast<uint4*>(base);
#pragma unroll
  for (int w = 0; w < Vec<T, V>::kWords; ++w) dst[w] = v.words[w];
}

// Elements per thread and step: 16 bytes of the narrower operand.
template <class P, class G>
struct VecWidth {
  static constexpr int value =
      16 / static_cast<int>(sizeof(typename P::T) < sizeof(typename G::T)
                                ? sizeof(typename P::T)
                                : sizeof(typename G::T));
};

template <class P, class G, bool kStochastic>
__device__ __forceinline__ typename P::T update_one(typename P::T old, typename G::T grad,
                                                    int64_t index, const lomo::LomoScalars& s,
                                                    uint32_t key, uint32_t& any_bad) {
  uint32_t bad;
  const float updated = lomo::lomo_element(G::load(grad), P::load(old), s, bad);
  const typename P::T out = lomo::store_rounded<P, kStochastic>(
      updated, static_cast<uint32_t>(index), static_cast<uint32_t>(index >> 32), key);
  any_bad |= bad;
  return bad ? old : out;
}

template <class P, class G, bool kStochastic>
__global__ void __launch_bounds__(kThreads)
    lomo_update_kernel(typename P::T* __restrict__ param, const typename G::T* __restrict__ grad,
                      int64_t head, int64_t nvec, int64_t numel, UpdateArgs a) {
  // Every thread reads the flag: all skip together, nothing is written.
  if (a.skip_if != nullptr && *a.skip_if != 0.0f) return;  // nan is non-zero too
  const lomo::LomoScalars s = resolve(a);
  uint32_t key = 0;
  if constexpr (kStochastic) key = rounding_key(a);
  constexpr int V = VecWidth<P, G>::value;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  uint32_t any_bad = 0;

  for (int64_t v = tid; v < nvec; v += stride) {
    const int64_t base = head + v * V;
    Vec<typename P::T, V> pv;
    Vec<typename G::T, V> gv;
    load_vec(pv, param + base);
    load_vec_ro(gv, grad + base);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      pv.e[j] = update_one<P, G, kStochastic>(pv.e[j], gv.e[j], base + j, s, key, any_bad);
    }
    store_vec(pv, param + base);
  }

  // Head [0, head) and tail [head + nvec * V, numel), one element per thread and step.
  const int64_t tail_start = head + nvec * V;
  const int64_t nscalar = head + (numel - tail_start);
  for (int64_t k = tid; k < nscalar; k += stride) {
    const int64_t i = k < head ? k : tail_start + (k - head);
    param[i] = update_one<P, G, kStochastic>(param[i], grad[i], i, s, key, any_bad);
  }

  // One store per warp that saw a non-finite gradient; all writers store the same 1.0f.
  if (a.found_inf != nullptr && __any_sync(0xFFFFFFFFu, any_bad) && (threadIdx.x & 31) == 0) {
    *a.found_inf = 1.0f;
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xFFFFFFFFu, v, offset);
  return v;
}

template <class G>
__global__ void __launch_bounds__(kThreads)
    grad_sumsq_kernel(const typename G::T* __restrict__ grad, int64_t head, int64_t nvec,
                      int64_t numel, const float* inv_scale, float* sumsq, float* found_inf) {
  const float inv = inv_scale != nullptr ? __ldg(inv_scale) : 1.0f;
  constexpr int V = 16 / static_cast<int>(sizeof(typename G::T));
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  float acc = 0.0f;
  uint32_t any_bad = 0;

  for (int64_t v = tid; v < nvec; v += stride) {
    Vec<typename G::T, V> gv;
    load_vec_ro(gv, grad + head + v * V);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float x = __fmul_rn(G::load(gv.e[j]), inv);
      acc = fmaf(x, x, acc);
      any_bad |= lomo::is_nonfinite(x);
    }
  }
  const int64_t tail_start = head + nvec * V;
  const int64_t nscalar = head + (numel - tail_start);
  for (int64_t k = tid; k < nscalar; k += stride) {
    const int64_t i = k < head ? k : tail_start + (k - head);
    const float x = __fmul_rn(G::load(grad[i]), inv);
    acc = fmaf(x, x, acc);
    any_bad |= lomo::is_nonfinite(x);
  }

  // Block reduction, then a single atomic per block.
  __shared__ float warp_sums[kThreads / 32];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  acc = warp_sum(acc);
  if (lane == 0) warp_sums[warp] = acc;
  __syncthreads();
  if (warp == 0) {
    acc = lane < kThreads / 32 ? warp_sums[lane] : 0.0f;
    acc = warp_sum(acc);
    if (lane == 0) atomicAdd(sumsq, acc);
  }
  if (found_inf != nullptr && __any_sync(0xFFFFFFFFu, any_bad) && lane == 0) *found_inf = 1.0f;
}

// Splits [0, numel) into a scalar head, nvec aligned vectors of V elements, and a tail.
// Without a common alignment everything goes through the scalar loop.
template <int V>
void split_aligned(const void* a, size_t a_size, const void* b, size_t b_size, int64_t numel,
                   int64_t& head, int64_t& nvec) {
  const uintptr_t pa = reinterpret_cast<uintptr_t>(a);
  const uintptr_t pb = reinterpret_cast<uintptr_t>(b);
  head = 0;
  nvec = 0;
  if (pa % a_size != 0 || pb % b_size != 0) return;
  const int64_t h = static_cast<int64_t>(((16 - pa % 16) % 16) / a_size);
  if (h >= numel || (pb + static_cast<uintptr_t>(h) * b_size) % 16 != 0) return;
  head = h;
  nvec = (numel - h) / V;
}

int sm_count() {
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

unsigned grid_for(int64_t work_items) {
  const int64_t wanted = (work_items + kThreads - 1) / kThreads;
  const int64_t cap = static_cast<int64_t>(sm_count()) * kBlocksPerSm;
  return static_cast<unsigned>(wanted < 1 ? 1 : (wanted < cap ? wanted : cap));
}

template <class F>
cudaError_t with_dtype(int code, F&& f) {
  switch (code) {
    case lomo::kFloat32:
      return f(lomo::Fp32{});
    case lomo::kFloat16:
      return f(lomo::Fp16{});
    case lomo::kBFloat16:
      return f(lomo::Bf16{});
    default:
      return cudaErrorInvalidValue;
  }
}

template <class P, class G, bool kStochastic>
cudaError_t launch_update(void* param, const void* grad, int64_t numel, const UpdateArgs& a,
                          cudaStream_t stream) {
  constexpr int V = VecWidth<P, G>::value;
  int64_t head, nvec;
  split_aligned<V>(param, sizeof(typename P::T), grad, sizeof(typename G::T), numel, head, nvec);
  const int64_t scalar = numel - nvec * V;
  const unsigned grid = grid_for(nvec > scalar ? nvec : scalar);
  lomo_update_kernel<P, G, kStochastic><<<grid, kThreads, 0, stream>>>(
      static_cast<typename P::T*>(param), static_cast<const typename G::T*>(grad), head, nvec,
      numel, a);
  return cudaGetLastError();
}

}  // namespace

int lomo_cuda_update(void* param, int param_dtype, const void* grad,
                     int grad_dtype, int64_t numel, const float* lr,
                     const float* inv_scale, float clip_value,
                     const float* clip_coef, float weight_decay,
                     const float* skip_if, float* found_inf,
                     int stochastic_rounding, uint32_t seed_lo_mixed,
                     uint32_t seed_hi_salted, const int64_t* seed_step,
                     cudaStream_t stream) {
  if (lr == nullptr) return cudaErrorInvalidValue;
  if (numel <= 0) return cudaSuccess;
  const UpdateArgs a{lr, inv_scale, clip_coef, clip_value, weight_decay, skip_if, found_inf,
                     seed_lo_mixed, seed_hi_salted, seed_step};
  return with_dtype(param_dtype, [&](auto p_tag) {
    return with_dtype(grad_dtype, [&](auto g_tag) {
      using P = decltype(p_tag);
      using G = decltype(g_tag);
      if constexpr (P::kRoundsStochastically) {  // bf16, fp16
        if (stochastic_rounding != 0) {
          return launch_update<P, G, true>(param, grad, numel, a, stream);
        }
      }
      return launch_update<P, G, false>(param, grad, numel, a, stream);
    });
  });
}

int lomo_cuda_grad_sumsq(const void* grad, int grad_dtype, int64_t numel,
                         const float* inv_scale, float* sumsq, float* found_inf,
                         cudaStream_t stream) {
  if (numel <= 0) return cudaSuccess;
  return with_dtype(grad_dtype, [&](auto g_tag) {
    using G = decltype(g_tag);
    constexpr int V = 16 / static_cast<int>(sizeof(typename G::T));
    int64_t head, nvec;
    split_aligned<V>(grad, sizeof(typename G::T), grad, sizeof(typename G::T), numel, head,
                     nvec);
    const int64_t scalar = numel - nvec * V;
    const unsigned grid = grid_for(nvec > scalar ? nvec : scalar);
    grad_sumsq_kernel<G><<<grid, kThreads, 0, stream>>>(
        static_cast<const typename G::T*>(grad), head, nvec, numel, inv_scale, sumsq, found_inf);
    return cudaGetLastError();
  });
}
