// CUDA kernels of the fused LOMO update, the gradient sum of squares and the gradient
// accumulation, with extern "C" launchers on raw pointers. No torch headers: `nvcc -std=c++17 -arch=sm_90 -c` builds it
// alone; lomo_cuda_binding.cpp is the torch side. Semantics: lomo_kernels/ops/lomo/reference.py.
//
// Layout of one launch: a scalar head (elements before both pointers are 16-byte aligned),
// an aligned bulk moved with 128-bit loads/stores (V elements per thread and step), and a
// scalar tail. Grid-stride loops with int64 indices; skip_if and the runtime scalars (lr,
// inv_scale, clip_coef: 1-element fp32 tensors; the rounding seed's per-step value, an int64)
// are read on the device through pointers, so the host never synchronises.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cuda_common.cuh"
#include "dtype_dispatch.h"
#include "lomo_cuda.h"
#include "lomo_math.h"

namespace {

constexpr int kThreads = 256;
// Enough resident blocks to hide latency; the grid-stride loop covers the rest.
constexpr int kBlocksPerSm = 8;

// The reference's fp32 arithmetic on the scalars.
__device__ __forceinline__ lomo::LomoScalars resolve(const LomoUpdateArgs& a) {
  lomo::LomoScalars s;
  s.lr = __ldg(a.lr);
  s.decay = __fsub_rn(1.0f, __fmul_rn(s.lr, a.weight_decay));
  s.inv_scale = a.inv_scale != nullptr ? __ldg(a.inv_scale) : 1.0f;
  s.clip = a.clip_value;
  s.coef = a.clip_coef != nullptr ? __ldg(a.clip_coef) : 1.0f;
  return s;
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

// The grid-stride walk of a launch split by split_aligned: vector(base) for each aligned
// vector of V elements from `base`, then scalar(i) for each element of the head [0, head) and
// the tail [head + nvec * V, numel), one per thread and step.
template <int V, class Vector, class Scalar>
__device__ __forceinline__ void for_each_aligned(int64_t head, int64_t nvec, int64_t numel,
                                                 Vector&& vector, Scalar&& scalar) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t v = tid; v < nvec; v += stride) vector(head + v * V);
  const int64_t tail_start = head + nvec * V;
  const int64_t nscalar = head + (numel - tail_start);
  for (int64_t k = tid; k < nscalar; k += stride) scalar(k < head ? k : tail_start + (k - head));
}

template <class P, class G, bool kStochastic>
__device__ __forceinline__ typename P::T update_one(typename P::T old, typename G::T grad,
                                                    int64_t index, const lomo::LomoScalars& s,
                                                    uint32_t key, uint32_t& any_bad) {
  uint32_t bad;
  const float updated = lomo::lomo_element(G::load(grad), P::load(old), s, bad);
  const typename P::T out = lomo::store_rounded<P, kStochastic>(updated, index, key);
  any_bad |= bad;
  return bad ? old : out;
}

template <class P, class G, bool kStochastic>
__global__ void __launch_bounds__(kThreads)
    lomo_update_kernel(typename P::T* __restrict__ param, const typename G::T* __restrict__ grad,
                      int64_t head, int64_t nvec, int64_t numel, LomoUpdateArgs a) {
  // Every thread reads the flag: all skip together, nothing is written.
  if (a.skip_if != nullptr && *a.skip_if != 0.0f) return;  // nan is non-zero too
  const lomo::LomoScalars s = resolve(a);
  uint32_t key = 0;
  if constexpr (kStochastic) key = cuda_common::rounding_key(a.rounding);
  constexpr int V = VecWidth<P, G>::value;
  uint32_t any_bad = 0;
  for_each_aligned<V>(
      head, nvec, numel,
      [&](int64_t base) {
        Vec<typename P::T, V> pv;
        Vec<typename G::T, V> gv;
        load_vec(pv, param + base);
        load_vec_ro(gv, grad + base);
#pragma unroll
        for (int j = 0; j < V; ++j) {
          pv.e[j] = update_one<P, G, kStochastic>(pv.e[j], gv.e[j], base + j, s, key, any_bad);
        }
        store_vec(pv, param + base);
      },
      [&](int64_t i) {
        param[i] = update_one<P, G, kStochastic>(param[i], grad[i], i, s, key, any_bad);
      });

  // One store per warp that saw a non-finite gradient; all writers store the same 1.0f.
  if (a.found_inf != nullptr && __any_sync(0xFFFFFFFFu, any_bad) && (threadIdx.x & 31) == 0) {
    *a.found_inf = 1.0f;
  }
}

// A block's sum of squares `acc` added to sumsq (when present) with one atomic per block, and
// found_inf set by each warp with a thread that saw a non-finite value. Every thread of the
// block calls it (a barrier inside).
__device__ __forceinline__ void report_sumsq(float acc, uint32_t any_bad, float* sumsq,
                                             float* found_inf) {
  __shared__ float warp_sums[kThreads / 32];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  if (sumsq != nullptr) {
    acc = cuda_common::warp_sum(acc);
    if (lane == 0) warp_sums[warp] = acc;
    __syncthreads();
    if (warp == 0) {
      acc = lane < kThreads / 32 ? warp_sums[lane] : 0.0f;
      acc = cuda_common::warp_sum(acc);
      if (lane == 0) atomicAdd(sumsq, acc);
    }
  }
  if (found_inf != nullptr && __any_sync(0xFFFFFFFFu, any_bad) && lane == 0) *found_inf = 1.0f;
}

template <class G>
__global__ void __launch_bounds__(kThreads)
    grad_sumsq_kernel(const typename G::T* __restrict__ grad, int64_t head, int64_t nvec,
                      int64_t numel, const float* inv_scale, float* sumsq, float* found_inf) {
  const float inv = inv_scale != nullptr ? __ldg(inv_scale) : 1.0f;
  constexpr int V = VecWidth<G, G>::value;
  float acc = 0.0f;
  uint32_t any_bad = 0;
  const auto add = [&](typename G::T stored) {
    const float x = __fmul_rn(G::load(stored), inv);
    acc = fmaf(x, x, acc);
    any_bad |= lomo::is_nonfinite(x);
  };
  for_each_aligned<V>(
      head, nvec, numel,
      [&](int64_t base) {
        Vec<typename G::T, V> gv;
        load_vec_ro(gv, grad + base);
#pragma unroll
        for (int j = 0; j < V; ++j) add(gv.e[j]);
      },
      [&](int64_t i) { add(grad[i]); });

  report_sumsq(acc, any_bad, sumsq, found_inf);
}

// buffer = round(buffer + grad) (kFirst: round(grad), the buffer not read), to nearest even or
// stochastically with the accumulation's stream (lomo::pair_bits16), in one pass; the stored
// values times inv_scale are measured as grad_sumsq_kernel measures the gradient (into sumsq
// and found_inf, either may be absent; the flag `measure` is the same for every thread, so the
// reduction's barrier is too).
template <class P, class G, bool kFirst, bool kStochastic>
__global__ void __launch_bounds__(kThreads)
    grad_accumulate_kernel(typename P::T* __restrict__ buffer,
                           const typename G::T* __restrict__ grad, int64_t head, int64_t nvec,
                           int64_t numel, GradAccumulateArgs a) {
  const float inv = a.inv_scale != nullptr ? __ldg(a.inv_scale) : 1.0f;
  uint32_t key = 0;
  if constexpr (kStochastic) key = cuda_common::rounding_key(a.rounding);
  constexpr int V = VecWidth<P, G>::value;
  float acc = 0.0f;
  uint32_t any_bad = 0;
  const auto add = [&](typename P::T old, typename G::T g, int64_t index) {
    const float v = kFirst ? G::load(g) : lomo::add_rn(P::load(old), G::load(g));
    const typename P::T out = lomo::store_accumulated<P, kStochastic>(v, index, key);
    const float x = __fmul_rn(P::load(out), inv);
    acc = fmaf(x, x, acc);
    any_bad |= lomo::is_nonfinite(x);
    return out;
  };
  for_each_aligned<V>(
      head, nvec, numel,
      [&](int64_t base) {
        Vec<typename P::T, V> bv;
        Vec<typename G::T, V> gv;
        if constexpr (!kFirst) load_vec(bv, buffer + base);
        load_vec_ro(gv, grad + base);
#pragma unroll
        for (int j = 0; j < V; ++j) bv.e[j] = add(bv.e[j], gv.e[j], base + j);
        store_vec(bv, buffer + base);
      },
      [&](int64_t i) {
        buffer[i] = add(kFirst ? typename P::T() : buffer[i], grad[i], i);
      });
  if (a.sumsq != nullptr || a.found_inf != nullptr) {
    report_sumsq(acc, any_bad, a.sumsq, a.found_inf);
  }
}

// [0, numel) as a scalar head, nvec aligned vectors of V elements and a tail, and the grid of
// its launch (a thread per vector or per scalar element, whichever part is larger). Without a
// common alignment everything goes through the scalar loop.
struct AlignedSplit {
  int64_t head = 0, nvec = 0;
  unsigned grid = 0;
};

template <int V>
AlignedSplit split_aligned(const void* a, size_t a_size, const void* b, size_t b_size,
                           int64_t numel) {
  const uintptr_t pa = reinterpret_cast<uintptr_t>(a);
  const uintptr_t pb = reinterpret_cast<uintptr_t>(b);
  AlignedSplit out;
  if (pa % a_size == 0 && pb % b_size == 0) {
    const int64_t h = static_cast<int64_t>(((16 - pa % 16) % 16) / a_size);
    if (h < numel && (pb + static_cast<uintptr_t>(h) * b_size) % 16 == 0) {
      out.head = h;
      out.nvec = (numel - h) / V;
    }
  }
  const int64_t scalar = numel - out.nvec * V;
  out.grid = cuda_common::grid_for(out.nvec > scalar ? out.nvec : scalar, kThreads, kBlocksPerSm);
  return out;
}

template <class P, class G, bool kStochastic>
cudaError_t launch_update(void* param, const void* grad, int64_t numel,
                          const LomoUpdateArgs& a, cudaStream_t stream) {
  const AlignedSplit split = split_aligned<VecWidth<P, G>::value>(
      param, sizeof(typename P::T), grad, sizeof(typename G::T), numel);
  lomo_update_kernel<P, G, kStochastic><<<split.grid, kThreads, 0, stream>>>(
      static_cast<typename P::T*>(param), static_cast<const typename G::T*>(grad), split.head,
      split.nvec, numel, a);
  return cudaGetLastError();
}

}  // namespace

int lomo_cuda_update(void* param, int param_dtype, const void* grad, int grad_dtype,
                     int64_t numel, LomoUpdateArgs args, cudaStream_t stream) {
  if (args.lr == nullptr) return cudaErrorInvalidValue;
  if (numel <= 0) return cudaSuccess;
  cudaError_t status = cudaErrorInvalidValue;
  lomo::dispatch_write_back(param_dtype, grad_dtype, args.rounding.stochastic != 0,
                            [&](auto p_tag, auto g_tag, auto stochastic) {
                              status = launch_update<decltype(p_tag), decltype(g_tag),
                                                     decltype(stochastic)::value>(
                                  param, grad, numel, args, stream);
                            });
  return status;
}

int lomo_cuda_grad_sumsq(const void* grad, int grad_dtype, int64_t numel,
                         const float* inv_scale, float* sumsq, float* found_inf,
                         cudaStream_t stream) {
  if (numel <= 0) return cudaSuccess;
  cudaError_t status = cudaErrorInvalidValue;
  lomo::dispatch_dtype(grad_dtype, [&](auto g_tag) {
    using G = decltype(g_tag);
    const AlignedSplit split = split_aligned<VecWidth<G, G>::value>(
        grad, sizeof(typename G::T), grad, sizeof(typename G::T), numel);
    grad_sumsq_kernel<G><<<split.grid, kThreads, 0, stream>>>(
        static_cast<const typename G::T*>(grad), split.head, split.nvec, numel, inv_scale, sumsq,
        found_inf);
    status = cudaGetLastError();
  });
  return status;
}

int lomo_cuda_grad_accumulate(void* buffer, int buffer_dtype, const void* grad, int grad_dtype,
                              int64_t numel, GradAccumulateArgs args, cudaStream_t stream) {
  if (numel <= 0) return cudaSuccess;
  cudaError_t status = cudaErrorInvalidValue;
  lomo::dispatch_write_back(
      buffer_dtype, grad_dtype, args.rounding.stochastic != 0,
      [&](auto p_tag, auto g_tag, auto stochastic) {
        lomo::dispatch_bool(args.first != 0, [&](auto first) {
          using P = decltype(p_tag);
          using G = decltype(g_tag);
          const AlignedSplit split = split_aligned<VecWidth<P, G>::value>(
              buffer, sizeof(typename P::T), grad, sizeof(typename G::T), numel);
          grad_accumulate_kernel<P, G, decltype(first)::value, decltype(stochastic)::value>
              <<<split.grid, kThreads, 0, stream>>>(static_cast<typename P::T*>(buffer),
                                                     static_cast<const typename G::T*>(grad),
                                                     split.head, split.nvec, numel, args);
          status = cudaGetLastError();
        });
      });
  return status;
}
