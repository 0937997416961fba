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
#include "int8_blocks.h"
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

template <class P, bool kStochastic>
__device__ __forceinline__ typename P::T update_one(typename P::T old, float grad, int64_t index,
                                                    const lomo::LomoScalars& s, uint32_t key,
                                                    uint32_t& any_bad) {
  uint32_t bad;
  const float updated = lomo::lomo_element(grad, P::load(old), s, bad);
  const typename P::T out = lomo::store_rounded<P, kStochastic>(updated, index, key);
  any_bad |= bad;
  return bad ? old : out;
}

// The update's gradient from a dense tensor of G: V fp32 values from `base` (a 128-bit aligned
// vector) or the value at `i`, read on the non-coherent path.
template <class G>
struct DenseGrad {
  const typename G::T* values;

  template <int V>
  __device__ __forceinline__ void load(int64_t base, float (&g)[V]) const {
    Vec<typename G::T, V> gv;
    load_vec_ro(gv, values + base);
#pragma unroll
    for (int j = 0; j < V; ++j) g[j] = G::load(gv.e[j]);
  }

  __device__ __forceinline__ float at(int64_t i) const { return G::load(__ldg(values + i)); }
};

// The update of one launch: param = the LOMO step of each element (lomo::lomo_element) with the
// gradient Grad gives (DenseGrad, Int8Values), V elements per vector; the write-back's
// stochastic rounding draws the bits of flat index index_base + i (i: the launch's element).
template <class P, bool kStochastic, int V, class Grad>
__device__ __forceinline__ void update_pass(typename P::T* __restrict__ param, const Grad& grad,
                                            int64_t head, int64_t nvec, int64_t numel,
                                            int64_t index_base, const LomoUpdateArgs& a) {
  // Every thread reads the flag: all skip together, nothing is written.
  if (a.skip_if != nullptr && *a.skip_if != 0.0f) return;  // nan is non-zero too
  const lomo::LomoScalars s = resolve(a);
  uint32_t key = 0;
  if constexpr (kStochastic) key = cuda_common::rounding_key(a.rounding);
  uint32_t any_bad = 0;
  for_each_aligned<V>(
      head, nvec, numel,
      [&](int64_t base) {
        Vec<typename P::T, V> pv;
        float g[V];
        load_vec(pv, param + base);
        grad.load(base, g);
#pragma unroll
        for (int j = 0; j < V; ++j) {
          pv.e[j] = update_one<P, kStochastic>(pv.e[j], g[j], index_base + base + j, s, key,
                                               any_bad);
        }
        store_vec(pv, param + base);
      },
      [&](int64_t i) {
        param[i] = update_one<P, kStochastic>(param[i], grad.at(i), index_base + i, s, key,
                                              any_bad);
      });

  // One store per warp that saw a non-finite gradient; all writers store the same 1.0f.
  if (a.found_inf != nullptr && __any_sync(0xFFFFFFFFu, any_bad) && (threadIdx.x & 31) == 0) {
    *a.found_inf = 1.0f;
  }
}

// `offset`: the flat index of param's element 0 in its parameter (a slice's).
template <class P, class G, bool kStochastic>
__global__ void __launch_bounds__(kThreads)
    lomo_update_kernel(typename P::T* __restrict__ param, const typename G::T* __restrict__ grad,
                      int64_t head, int64_t nvec, int64_t numel, int64_t offset,
                      LomoUpdateArgs a) {
  update_pass<P, kStochastic, VecWidth<P, G>::value>(param, DenseGrad<G>{grad}, head, nvec,
                                                     numel, offset, a);
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
// reduction's barrier is too). `offset`: the flat index of buffer's element 0 in its
// parameter, whose bits the rounding draws.
template <class P, class G, bool kFirst, bool kStochastic>
__global__ void __launch_bounds__(kThreads)
    grad_accumulate_kernel(typename P::T* __restrict__ buffer,
                           const typename G::T* __restrict__ grad, int64_t head, int64_t nvec,
                           int64_t numel, int64_t offset, GradAccumulateArgs a) {
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
        for (int j = 0; j < V; ++j) bv.e[j] = add(bv.e[j], gv.e[j], offset + base + j);
        store_vec(bv, buffer + base);
      },
      [&](int64_t i) {
        buffer[i] = add(kFirst ? typename P::T() : buffer[i], grad[i], offset + i);
      });
  if (a.sumsq != nullptr || a.found_inf != nullptr) {
    report_sumsq(acc, any_bad, a.sumsq, a.found_inf);
  }
}

// ----------------------------------------------------------------------------- 8-bit buffer
// lomo_kernels/core/int8_blocks.py: int8 codes, one power-of-two fp32 scale per kInt8Block
// elements of the parameter's flat index; a buffer's element j lies in its block
// (lead + j) / kInt8Block with lead = offset % kInt8Block (offset >= 0).

constexpr int kInt8Block = static_cast<int>(int8_blocks::kBlock);
// A block is quantised by a group of kInt8Group threads of one warp, kInt8PerThread
// consecutive elements each: one 128-bit vector of codes per thread.
constexpr int kInt8PerThread = 16;
constexpr int kInt8Group = kInt8Block / kInt8PerThread;
constexpr int kInt8GroupsPerCta = kThreads / kInt8Group;
// Resident CTAs per multiprocessor the accumulation is compiled for (at most 64 registers).
constexpr int kInt8CtasPerSm = 4;
constexpr int kInt8MaxCode = static_cast<int>(int8_blocks::kMaxCode);

// The storage tag of the codes (one byte each), for VecWidth.
struct Int8Code {
  using T = int8_t;
};

// The fp32 values code * scale of an 8-bit buffer (exact: the scales are powers of two; a nan
// scale gives nan), V from `base` (a 128-bit aligned vector of codes, V <= kInt8Block, so
// across at most two blocks) or the one at `i`, read on the non-coherent path.
struct Int8Values {
  const int8_t* codes;
  const float* scales;
  int64_t lead;

  template <int V>
  __device__ __forceinline__ void load(int64_t base, float (&v)[V]) const {
    static_assert(V <= kInt8Block, "a vector spans at most two blocks");
    Vec<int8_t, V> cv;
    load_vec_ro(cv, codes + base);
    const int64_t block = (lead + base) / kInt8Block;
    const float first_scale = __ldg(scales + block);
    const float next_scale = __ldg(scales + (lead + base + V - 1) / kInt8Block);
    const int64_t in_first = (block + 1) * kInt8Block - lead - base;  // elements in `block`
#pragma unroll
    for (int j = 0; j < V; ++j) {
      v[j] = __fmul_rn(static_cast<float>(cv.e[j]), j < in_first ? first_scale : next_scale);
    }
  }

  __device__ __forceinline__ float at(int64_t i) const {
    const float scale = __ldg(scales + (lead + i) / kInt8Block);
    return __fmul_rn(static_cast<float>(__ldg(codes + i)), scale);
  }
};

// The code of a finite value x = new * (1 / scale) (|x| <= 127; the reference's fp32 product,
// exact but where it falls below fp32's normal range): to nearest even, or
// x + u to nearest even with u = (2 r + 1 - 2**16) / 2**17 for r the accumulation's 16
// random bits (lomo::pair_bits16) of flat `index`: a centred offset in (-1/2, 1/2) (x + u is
// one fp32 rounding, as the reference's).
template <bool kStochastic>
__device__ __forceinline__ int int8_code_of(float x, int64_t index, uint32_t key) {
  int code;
  if constexpr (kStochastic) {
    const uint32_t bits = lomo::pair_bits16(static_cast<uint32_t>(index),
                                            static_cast<uint32_t>(index >> 32), key);
    const int centred = static_cast<int>(2u * bits + 1u) - 65536;
    const float u = __fmul_rn(static_cast<float>(centred), 1.0f / 131072.0f);  // exact
    code = __float2int_rn(__fadd_rn(x, u));  // half to even
  } else {
    code = __float2int_rn(x);  // half to even
  }
  return min(max(code, -kInt8MaxCode), kInt8MaxCode);
}

// One thread's share of a block: kInt8PerThread consecutive elements of the buffer from
// `start` (negative or past numel where the block is partial). `vector`: all inside, their
// codes and gradient 128-bit aligned.
struct Int8Share {
  int64_t start;
  int64_t numel;
  bool vector;

  __device__ __forceinline__ bool holds(int e) const {
    return vector || (start + e >= 0 && start + e < numel);
  }
};

// The share's new values: grad, plus code * old_scale unless kFirst (one fp32 rounding: the
// product is exact); 0 where the share holds no element.
template <class G, bool kFirst>
__device__ __forceinline__ void load_new_values(float (&v)[kInt8PerThread], const Int8Share& share,
                                                const int8_t* codes, float old_scale,
                                                const typename G::T* grad) {
  const auto add = [&](int8_t code, typename G::T g) {
    return kFirst ? G::load(g)
                  : lomo::add_rn(__fmul_rn(static_cast<float>(code), old_scale), G::load(g));
  };
  if (share.vector) {
    Vec<typename G::T, kInt8PerThread> gv;
    Vec<int8_t, kInt8PerThread> cv;
    load_vec_ro(gv, grad + share.start);
    if constexpr (!kFirst) load_vec(cv, codes + share.start);
#pragma unroll
    for (int e = 0; e < kInt8PerThread; ++e) v[e] = add(kFirst ? 0 : cv.e[e], gv.e[e]);
    return;
  }
#pragma unroll
  for (int e = 0; e < kInt8PerThread; ++e) {
    const int64_t j = share.start + e;
    v[e] = share.holds(e) ? add(kFirst ? 0 : codes[j], __ldg(grad + j)) : 0.0f;
  }
}

// The largest bits of |v| over the share and the rest of its group (`group_mask`, aligned
// lanes of one warp): magnitudes compare as their bits, and any inf/nan's exceed every finite
// one. Butterfly shuffles within the group (any architecture; lane offsets < kInt8Group).
__device__ __forceinline__ uint32_t group_absmax_bits(const float (&v)[kInt8PerThread],
                                                     unsigned group_mask) {
  uint32_t largest = 0;
#pragma unroll
  for (int e = 0; e < kInt8PerThread; ++e) {
    largest = max(largest, __float_as_uint(v[e]) & int8_blocks::kMagnitudeMask);
  }
#pragma unroll
  for (int lanes = kInt8Group / 2; lanes > 0; lanes /= 2) {
    largest = max(largest, __shfl_xor_sync(group_mask, largest, lanes));
  }
  return largest;
}

// The share's codes (0 for a block holding an inf/nan), each element's rounding bits at flat
// index `first_index` + e.
template <bool kStochastic>
__device__ __forceinline__ void quantise(Vec<int8_t, kInt8PerThread>& cv,
                                         const float (&v)[kInt8PerThread], bool bad,
                                         float inverse, int64_t first_index, uint32_t key) {
#pragma unroll
  for (int e = 0; e < kInt8PerThread; ++e) {
    const float x = __fmul_rn(v[e], inverse);
    cv.e[e] = static_cast<int8_t>(bad ? 0 : int8_code_of<kStochastic>(x, first_index + e, key));
  }
}

// The share's codes stored, and the stored values code * scale times inv_scale measured (their
// squares into acc, any inf/nan into any_bad) as grad_accumulate_kernel measures its own.
__device__ __forceinline__ void store_and_measure(const Vec<int8_t, kInt8PerThread>& cv,
                                                  const Int8Share& share, int8_t* codes,
                                                  float scale, float inv, float& acc,
                                                  uint32_t& any_bad) {
#pragma unroll
  for (int e = 0; e < kInt8PerThread; ++e) {
    if (!share.holds(e)) continue;
    const float x = __fmul_rn(__fmul_rn(static_cast<float>(cv.e[e]), scale), inv);
    acc = fmaf(x, x, acc);
    any_bad |= lomo::is_nonfinite(x);
    if (!share.vector) codes[share.start + e] = cv.e[e];
  }
  if (share.vector) store_vec(cv, codes + share.start);
}

// codes, scales = the 8-bit buffer of new = code * scale + grad (kFirst: grad, the buffer not
// read), one pass: a group of kInt8Group threads per block holds the block's new values in
// registers, reduces their largest magnitude, and stores the codes and the power-of-two scale
// (a block with an inf/nan: codes 0, scale nan); the stored values times inv_scale are
// measured into sumsq and found_inf as grad_accumulate_kernel's. `aligned`: codes and grad are
// 128-bit aligned where the parameter's blocks start (lead elements before them), so every
// whole share moves as vectors.
template <class G, bool kFirst, bool kStochastic>
__global__ void __launch_bounds__(kThreads, kInt8CtasPerSm)
    grad_accumulate_int8_kernel(int8_t* __restrict__ codes, float* __restrict__ scales,
                                const typename G::T* __restrict__ grad, int64_t offset,
                                int64_t numel, int64_t blocks, bool aligned,
                                GradAccumulateArgs a) {
  const float inv = a.inv_scale != nullptr ? __ldg(a.inv_scale) : 1.0f;
  uint32_t key = 0;
  if constexpr (kStochastic) key = cuda_common::rounding_key(a.rounding);
  const int64_t lead = offset % kInt8Block;
  const int member = threadIdx.x % kInt8Group;
  // The group's lanes of its warp: its reduction waits for them alone (the warp's other group
  // may be on another block, or done).
  const unsigned group_mask = ((1u << kInt8Group) - 1u) << (threadIdx.x % 32 - member);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kInt8GroupsPerCta;
  const int64_t first_block =
      static_cast<int64_t>(blockIdx.x) * kInt8GroupsPerCta + threadIdx.x / kInt8Group;
  float acc = 0.0f;
  uint32_t any_bad = 0;
  for (int64_t block = first_block; block < blocks; block += stride) {
    const int64_t start = block * kInt8Block - lead + member * kInt8PerThread;
    const Int8Share share{start, numel,
                          aligned && start >= 0 && start + kInt8PerThread <= numel};
    // Read by the whole group before the reduction, written by its first member after it.
    const float old_scale = kFirst ? 0.0f : scales[block];
    float v[kInt8PerThread];
    load_new_values<G, kFirst>(v, share, codes, old_scale, grad);
    const uint32_t absmax_bits = group_absmax_bits(v, group_mask);
    const bool bad = absmax_bits >= lomo::kNonFiniteExponent;
    const int8_blocks::Scale s = int8_blocks::power_of_two(bad ? 0u : absmax_bits);
    const float scale = bad ? __uint_as_float(int8_blocks::kNanScaleBits) : s.scale;
    Vec<int8_t, kInt8PerThread> cv;
    quantise<kStochastic>(cv, v, bad, s.inverse, offset + start, key);
    store_and_measure(cv, share, codes, scale, inv, acc, any_bad);
    if (member == 0) scales[block] = scale;
  }
  if (a.sumsq != nullptr || a.found_inf != nullptr) {
    report_sumsq(acc, any_bad, a.sumsq, a.found_inf);
  }
}

template <class P, bool kStochastic>
__global__ void __launch_bounds__(kThreads)
    lomo_update_int8_kernel(typename P::T* __restrict__ param, const int8_t* __restrict__ codes,
                            const float* __restrict__ scales, int64_t offset, int64_t head,
                            int64_t nvec, int64_t numel, LomoUpdateArgs a) {
  update_pass<P, kStochastic, VecWidth<P, Int8Code>::value>(
      param, Int8Values{codes, scales, offset % kInt8Block}, head, nvec, numel, offset, a);
}

// A dequantized value as the reference's CPU product gives it: a nan scale's own bits
// (float("nan")) where the device's arithmetic would give its canonical nan, so a bf16 out
// stores the reference's nan.
__device__ __forceinline__ float as_reference_nan(float v) {
  return lomo::is_nan(v) ? __uint_as_float(int8_blocks::kNanScaleBits) : v;
}

// out = code * scale, rounded to out's type (exact in fp32 and bf16).
template <class P>
__global__ void __launch_bounds__(kThreads)
    int8_dequantize_kernel(typename P::T* __restrict__ out, const int8_t* __restrict__ codes,
                           const float* __restrict__ scales, int64_t offset, int64_t head,
                           int64_t nvec, int64_t numel) {
  constexpr int V = VecWidth<P, Int8Code>::value;
  const Int8Values values{codes, scales, offset % kInt8Block};
  for_each_aligned<V>(
      head, nvec, numel,
      [&](int64_t base) {
        float v[V];
        Vec<typename P::T, V> ov;
        values.load(base, v);
#pragma unroll
        for (int j = 0; j < V; ++j) ov.e[j] = P::round(as_reference_nan(v[j]));
        store_vec(ov, out + base);
      },
      [&](int64_t i) { out[i] = P::round(as_reference_nan(values.at(i))); });
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
cudaError_t launch_update(void* param, const void* grad, int64_t numel, int64_t offset,
                          const LomoUpdateArgs& a, cudaStream_t stream) {
  const AlignedSplit split = split_aligned<VecWidth<P, G>::value>(
      param, sizeof(typename P::T), grad, sizeof(typename G::T), numel);
  lomo_update_kernel<P, G, kStochastic><<<split.grid, kThreads, 0, stream>>>(
      static_cast<typename P::T*>(param), static_cast<const typename G::T*>(grad), split.head,
      split.nvec, numel, offset, a);
  return cudaGetLastError();
}

}  // namespace

int lomo_cuda_update(void* param, int param_dtype, const void* grad, int grad_dtype,
                     int64_t numel, int64_t offset, LomoUpdateArgs args, cudaStream_t stream) {
  if (args.lr == nullptr || offset < 0) return cudaErrorInvalidValue;
  if (numel <= 0) return cudaSuccess;
  cudaError_t status = cudaErrorInvalidValue;
  lomo::dispatch_write_back(param_dtype, grad_dtype, args.rounding.stochastic != 0,
                            [&](auto p_tag, auto g_tag, auto stochastic) {
                              status = launch_update<decltype(p_tag), decltype(g_tag),
                                                     decltype(stochastic)::value>(
                                  param, grad, numel, offset, args, stream);
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
                              int64_t numel, int64_t offset, GradAccumulateArgs args,
                              cudaStream_t stream) {
  if (offset < 0) return cudaErrorInvalidValue;
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
                                                     split.head, split.nvec, numel, offset,
                                                     args);
          status = cudaGetLastError();
        });
      });
  return status;
}

namespace {

// Whether the buffer's elements are 128-bit aligned where its parameter's blocks are: the
// address `lead` elements of `size` bytes before p is.
bool aligned_to_blocks(const void* p, size_t size, int64_t lead) {
  return (reinterpret_cast<uintptr_t>(p) - static_cast<uintptr_t>(lead) * size) % 16 == 0;
}

}  // namespace

int lomo_cuda_grad_accumulate_int8(LomoInt8Buffer buffer, const void* grad, int grad_dtype,
                                   int64_t numel, GradAccumulateArgs args, cudaStream_t stream) {
  if (numel <= 0) return cudaSuccess;
  if (buffer.offset < 0) return cudaErrorInvalidValue;
  const int64_t blocks = int8_blocks::blocks_of(buffer.offset, numel);
  const int64_t lead = buffer.offset % kInt8Block;
  const unsigned grid = cuda_common::grid_for(blocks, kInt8GroupsPerCta, kInt8CtasPerSm);
  cudaError_t status = cudaErrorInvalidValue;
  lomo::dispatch_dtype(grad_dtype, [&](auto g_tag) {
    using G = decltype(g_tag);
    const bool aligned = aligned_to_blocks(buffer.codes, 1, lead) &&
                         aligned_to_blocks(grad, sizeof(typename G::T), lead);
    lomo::dispatch_bool(args.first != 0, [&](auto first) {
      lomo::dispatch_bool(args.rounding.stochastic != 0, [&](auto stochastic) {
        grad_accumulate_int8_kernel<G, decltype(first)::value, decltype(stochastic)::value>
            <<<grid, kThreads, 0, stream>>>(buffer.codes, buffer.scales,
                                            static_cast<const typename G::T*>(grad),
                                            buffer.offset, numel, blocks, aligned, args);
        status = cudaGetLastError();
      });
    });
  });
  return status;
}

int lomo_cuda_update_int8(void* param, int param_dtype, LomoInt8Buffer buffer, int64_t numel,
                          LomoUpdateArgs args, cudaStream_t stream) {
  if (args.lr == nullptr || buffer.offset < 0) return cudaErrorInvalidValue;
  if (numel <= 0) return cudaSuccess;
  cudaError_t status = cudaErrorInvalidValue;
  lomo::dispatch_dtype(param_dtype, [&](auto p_tag) {
    using P = decltype(p_tag);
    lomo::dispatch_rounding<P>(args.rounding.stochastic != 0, [&](auto stochastic) {
      const AlignedSplit split = split_aligned<VecWidth<P, Int8Code>::value>(
          param, sizeof(typename P::T), buffer.codes, 1, numel);
      lomo_update_int8_kernel<P, decltype(stochastic)::value>
          <<<split.grid, kThreads, 0, stream>>>(static_cast<typename P::T*>(param),
                                                buffer.codes, buffer.scales, buffer.offset,
                                                split.head, split.nvec, numel, args);
      status = cudaGetLastError();
    });
  });
  return status;
}

int lomo_cuda_int8_dequantize(void* out, int out_dtype, LomoInt8Buffer buffer, int64_t numel,
                              cudaStream_t stream) {
  if (buffer.offset < 0) return cudaErrorInvalidValue;
  if (numel <= 0) return cudaSuccess;
  cudaError_t status = cudaErrorInvalidValue;
  lomo::dispatch_dtype(out_dtype, [&](auto p_tag) {
    using P = decltype(p_tag);
    const AlignedSplit split = split_aligned<VecWidth<P, Int8Code>::value>(
        out, sizeof(typename P::T), buffer.codes, 1, numel);
    int8_dequantize_kernel<P><<<split.grid, kThreads, 0, stream>>>(
        static_cast<typename P::T*>(out), buffer.codes, buffer.scales, buffer.offset,
        split.head, split.nvec, numel);
    status = cudaGetLastError();
  });
  return status;
}
