// CUDA kernels of the fused AdaLomo passes and their extern "C" launchers (adalomo_cuda.h).
// Semantics: lomo_kernels/ops/adalomo/reference.py. Builds with nvcc alone (no torch).
//
// Factored tensors ([rows, cols]): a block of 8 warps owns 128 columns and a group of rows;
// each warp walks rows, every lane handling 4 columns 32 apart, so each warp load covers 32
// consecutive elements. Row partial sums are warp-reduced and added atomically once per row
// and block; column partial sums stay in registers over the row group and are added
// atomically once per block. 1-D tensors use grid-stride loops. Math is fp32; the products
// go through __fmul_rn so no FMA contraction changes the rounding of the reference.
#include <cuda_runtime.h>
#include <stdint.h>

#include "adalomo_cuda.h"
#include "adalomo_math.h"
#include "cuda_common.cuh"
#include "dtype_dispatch.h"

namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kColsPerLane = 4;
constexpr int kTileCols = 32 * kColsPerLane;
// Resident blocks per SM the launchers aim for (2048 threads / kThreads).
constexpr int kBlocksPerSm = 8;
constexpr int kMaxGridY = 65535;

// Sum over the block, valid in thread 0; every thread must call it.
__device__ float block_sum(float v) {
  __shared__ float scratch[kWarps];
  v = cuda_common::warp_sum(v);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  float total = 0.0f;
  if (threadIdx.x == 0) {
    for (int w = 0; w < kWarps; ++w) total += scratch[w];
  }
  __syncthreads();
  return total;
}

// flag = max(flag, 1): integer max orders non-negative floats like floats, and any negative
// float (sign bit set) below 1.0f.
__device__ __forceinline__ void raise_to_one(float* flag) {
  atomicMax(reinterpret_cast<int*>(flag), __float_as_int(1.0f));
}

// Whether this block of a stats pass runs, decided once by thread 0 so that the whole block
// agrees even while other blocks are raising the SKIP slot; a block that does not run raises it
// too (the caller's skip_if skips the tensor).
__device__ bool block_runs(float* stats, const float* skip_if) {
  __shared__ int run;
  if (threadIdx.x == 0) {
    bool r = *reinterpret_cast<const volatile float*>(stats + adalomo::kSkip) == 0.0f;
    if (skip_if != nullptr) r = r && (*skip_if == 0.0f);  // nan skips too
    run = r ? 1 : 0;
  }
  __syncthreads();
  if (run == 0 && threadIdx.x == 0) raise_to_one(stats + adalomo::kSkip);
  return run != 0;
}

// The end of a stats pass: thread 0 adds the block's sums `first` and `second` to their slots,
// in that order, and, when any thread saw a non-finite gradient (`bad`), marks the tensor
// skipped and raises found_inf. Every thread must call it.
__device__ __forceinline__ void commit_block(float* stats, int first_slot, float first,
                                             int second_slot, float second, uint32_t bad,
                                             float* found_inf) {
  const int any_bad = __syncthreads_or(bad != 0);
  if (threadIdx.x == 0) {
    atomicAdd(stats + first_slot, first);
    atomicAdd(stats + second_slot, second);
    if (any_bad) {
      raise_to_one(stats + adalomo::kSkip);
      if (found_inf != nullptr) raise_to_one(found_inf);
    }
  }
}

__device__ adalomo::GradScalars resolve(const AdalomoGradArgs& a) {
  adalomo::GradScalars s;
  s.inv_scale = a.inv_scale != nullptr ? *a.inv_scale : 1.0f;
  s.clip = a.has_clip_value ? a.clip_value : __int_as_float(0x7F800000);
  s.coef = a.clip_coef != nullptr ? *a.clip_coef : 1.0f;
  return s;
}

// (b, 1 - b) in fp32, as the reference forms them from a tensor beta2.
__device__ void resolve_beta(const float* beta2, float& b, float& one_minus_b) {
  b = *beta2;
  one_minus_b = __fsub_rn(1.0f, b);
}

__device__ adalomo::StepScalars resolve_step(const AdalomoStepArgs& a, const float* stats,
                                             float numel) {
  return adalomo::step_scalars(stats, numel, *a.lr, a.eps1, a.clip_threshold, a.weight_decay);
}

// ----------------------------------------------------------------------------- factored

// This block's part of a factored pass: kTileCols columns from col0 and the rows
// [row0, row1); warp `warp` walks rows row0 + warp, row0 + warp + kWarps, ..., and lane
// `lane` takes columns col0 + lane + 32 * k.
struct BlockTile {
  int warp, lane;
  int64_t col0, row0, row1;
};

// `first_row`: the grid's row 0 is that row of the matrix; `rows` its end.
__device__ __forceinline__ BlockTile block_tile(int64_t rows, int64_t rows_per_block,
                                                int64_t first_row = 0) {
  BlockTile t;
  t.warp = threadIdx.x / 32;
  t.lane = threadIdx.x % 32;
  t.col0 = static_cast<int64_t>(blockIdx.x) * kTileCols;
  t.row0 = first_row + static_cast<int64_t>(blockIdx.y) * rows_per_block;
  t.row1 = min(t.row0 + rows_per_block, rows);
  return t;
}

// The flat elements [begin, end) of a [rows, cols] matrix that a pass's grad (and param)
// hold, from element 0 of theirs: the whole matrix, or a slice of it cut across rows.
struct MatrixSlice {
  int64_t begin, end;
  __device__ __forceinline__ int64_t first_row(int64_t cols) const { return begin / cols; }
  __device__ __forceinline__ int64_t end_row(int64_t cols) const {
    return (end + cols - 1) / cols;
  }
  __device__ __forceinline__ bool holds(int64_t flat) const { return flat >= begin && flat < end; }
};

// Passes B and C: visit(index in the matrix, index in grad, update) for each element of
// `slice` in this block's tile, with update = rsqrt(R_i / mean(R)) * rsqrt(C_j) * g_ij; the
// grid's rows are the slice's.
template <class G, class Visit>
__device__ __forceinline__ void for_each_update(const typename G::T* __restrict__ grad,
                                                const float* __restrict__ row_state,
                                                const float* __restrict__ col_state,
                                                const float* stats, int64_t rows, int64_t cols,
                                                MatrixSlice slice, int64_t rows_per_block,
                                                const adalomo::GradScalars& s, Visit&& visit) {
  const float mean = stats[adalomo::kRSum] / static_cast<float>(rows);
  const BlockTile t = block_tile(slice.end_row(cols), rows_per_block, slice.first_row(cols));
  float c[kColsPerLane];
#pragma unroll
  for (int k = 0; k < kColsPerLane; ++k) {
    const int64_t j = t.col0 + t.lane + 32 * k;
    c[k] = j < cols ? adalomo::rsqrt_f(col_state[j]) : 0.0f;
  }
  for (int64_t i = t.row0 + t.warp; i < t.row1; i += kWarps) {
    const int64_t base = i * cols;
    const float r = adalomo::rsqrt_f(row_state[i] / mean);
#pragma unroll
    for (int k = 0; k < kColsPerLane; ++k) {
      const int64_t j = t.col0 + t.lane + 32 * k;
      const int64_t flat = base + j;
      if (j < cols && slice.holds(flat)) {
        uint32_t b;
        const int64_t at = flat - slice.begin;
        visit(flat, at,
              __fmul_rn(__fmul_rn(r, c[k]), adalomo::grad_g(G::load(grad[at]), s, b)));
      }
    }
  }
}

// Pass A over the elements of `slice` (grad and param hold them from their element 0; the
// grid's rows are the slice's). g is clamped but not scaled by the clip coefficient (the
// moments kernel applies it), so grad_args.clip_coef is unused; h = grad * inv_scale is also
// summed squared.
template <class P, class G>
__global__ void __launch_bounds__(kThreads)
factored_stats_kernel(const typename G::T* __restrict__ grad,
                      const typename P::T* __restrict__ param, float* __restrict__ ws,
                      float* found_inf, const float* skip_if, int64_t rows, int64_t cols,
                      MatrixSlice slice, int64_t rows_per_block, AdalomoGradArgs grad_args) {
  float* stats = ws + rows + cols;
  if (!block_runs(stats, skip_if)) return;
  const adalomo::GradScalars s = resolve(grad_args);
  const BlockTile t = block_tile(slice.end_row(cols), rows_per_block, slice.first_row(cols));
  float col_acc[kColsPerLane] = {};
  float p_acc = 0.0f, h_acc = 0.0f;
  uint32_t bad = 0;
  for (int64_t i = t.row0 + t.warp; i < t.row1; i += kWarps) {
    const int64_t base = i * cols;
    float row_acc = 0.0f;
#pragma unroll
    for (int k = 0; k < kColsPerLane; ++k) {
      const int64_t j = t.col0 + t.lane + 32 * k;
      const int64_t flat = base + j;
      if (j < cols && slice.holds(flat)) {
        const int64_t at = flat - slice.begin;
        uint32_t b;
        const float h = adalomo::scaled_grad(G::load(grad[at]), s, b);
        const float g = adalomo::clamp_grad(h, s);
        const float k2 = __fmul_rn(g, g);
        row_acc += k2;
        col_acc[k] += k2;
        h_acc = fmaf(h, h, h_acc);  // as grad_sumsq_ on CUDA
        const float p = P::load(param[at]);
        p_acc += __fmul_rn(p, p);
        bad |= b;
      }
    }
    row_acc = cuda_common::warp_sum(row_acc);
    if (t.lane == 0) atomicAdd(ws + i, row_acc);
  }
  __shared__ float col_scratch[kWarps][kTileCols];
#pragma unroll
  for (int k = 0; k < kColsPerLane; ++k) col_scratch[t.warp][t.lane + 32 * k] = col_acc[k];
  const float p_total = block_sum(p_acc);  // its barrier also publishes col_scratch
  if (threadIdx.x < kTileCols && t.col0 + threadIdx.x < cols) {
    float total = 0.0f;
    for (int w = 0; w < kWarps; ++w) total += col_scratch[w][threadIdx.x];
    atomicAdd(ws + rows + t.col0 + threadIdx.x, total);
  }
  const float h_total = block_sum(h_acc);
  commit_block(stats, adalomo::kPSumsq, p_total, adalomo::kGSumsq, h_total, bad, found_inf);
}

__global__ void __launch_bounds__(kThreads)
factored_moments_kernel(float* __restrict__ row_state, float* __restrict__ col_state,
                        float* __restrict__ ws, int64_t rows, int64_t cols, const float* beta2,
                        const float* clip_coef, float eps0) {
  float* stats = ws + rows + cols;
  if (stats[adalomo::kSkip] != 0.0f) return;  // final after pass A: uniform
  float b, one_minus_b;
  resolve_beta(beta2, b, one_minus_b);
  const float coef = clip_coef != nullptr ? *clip_coef : 1.0f;
  const int64_t k = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  float row_value = 0.0f;
  if (k < rows) {
    const float mean = adalomo::mean_u(ws[k], static_cast<float>(cols), coef, eps0);
    row_value = __fmul_rn(row_state[k], b) + __fmul_rn(mean, one_minus_b);
    row_state[k] = row_value;
  } else if (k < rows + cols) {
    const int64_t j = k - rows;
    const float mean = adalomo::mean_u(ws[rows + j], static_cast<float>(rows), coef, eps0);
    col_state[j] = __fmul_rn(col_state[j], b) + __fmul_rn(mean, one_minus_b);
  }
  const float total = block_sum(row_value);
  if (threadIdx.x == 0 && static_cast<int64_t>(blockIdx.x) * kThreads < rows) {
    atomicAdd(stats + adalomo::kRSum, total);
  }
}

template <class G>
__global__ void __launch_bounds__(kThreads)
factored_norm_kernel(const typename G::T* __restrict__ grad,
                     const float* __restrict__ row_state, const float* __restrict__ col_state,
                     float* __restrict__ ws, int64_t rows, int64_t cols, MatrixSlice slice,
                     int64_t rows_per_block, AdalomoGradArgs grad_args) {
  float* stats = ws + rows + cols;
  if (stats[adalomo::kSkip] != 0.0f) return;
  const adalomo::GradScalars s = resolve(grad_args);
  float acc = 0.0f;
  for_each_update<G>(grad, row_state, col_state, stats, rows, cols, slice, rows_per_block, s,
                     [&](int64_t, int64_t, float update) { acc += __fmul_rn(update, update); });
  const float total = block_sum(acc);
  if (threadIdx.x == 0) atomicAdd(stats + adalomo::kUSumsq, total);
}

template <class P, class G, bool kStochastic>
__global__ void __launch_bounds__(kThreads)
factored_apply_kernel(typename P::T* __restrict__ param, const typename G::T* __restrict__ grad,
                      const float* __restrict__ row_state, const float* __restrict__ col_state,
                      const float* __restrict__ ws, int64_t rows, int64_t cols,
                      MatrixSlice slice, int64_t rows_per_block, AdalomoStepArgs step_args,
                      AdalomoGradArgs grad_args, LomoRoundingArgs rounding) {
  const float* stats = ws + rows + cols;
  if (stats[adalomo::kSkip] != 0.0f) return;
  const adalomo::GradScalars s = resolve(grad_args);
  const adalomo::StepScalars step =
      resolve_step(step_args, stats, static_cast<float>(rows * cols));
  const uint32_t key = kStochastic ? cuda_common::rounding_key(rounding) : 0u;
  for_each_update<G>(grad, row_state, col_state, stats, rows, cols, slice, rows_per_block, s,
                     [&](int64_t flat, int64_t at, float update) {
                       param[at] = lomo::store_rounded<P, kStochastic>(
                           adalomo::apply(P::load(param[at]), update, step), flat, key);
                     });
}

// ----------------------------------------------------------------------------- 1-D

template <class P, class G>
__global__ void __launch_bounds__(kThreads)
vector_stats_kernel(const typename G::T* __restrict__ grad,
                    const typename P::T* __restrict__ param, const float* __restrict__ v,
                    float* __restrict__ ws, float* found_inf, const float* skip_if, int64_t n,
                    const float* beta2, float eps0, AdalomoGradArgs grad_args) {
  if (!block_runs(ws, skip_if)) return;
  const adalomo::GradScalars s = resolve(grad_args);
  float b, one_minus_b;
  resolve_beta(beta2, b, one_minus_b);
  float u_acc = 0.0f, p_acc = 0.0f;
  uint32_t bad = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; k < n;
       k += stride) {
    uint32_t bk;
    const float g = adalomo::grad_g(G::load(grad[k]), s, bk);
    const float update =
        __fmul_rn(adalomo::rsqrt_f(adalomo::moment(v[k], g, b, one_minus_b, eps0)), g);
    u_acc += __fmul_rn(update, update);
    const float p = P::load(param[k]);
    p_acc += __fmul_rn(p, p);
    bad |= bk;
  }
  const float u_total = block_sum(u_acc);
  const float p_total = block_sum(p_acc);
  commit_block(ws, adalomo::kUSumsq, u_total, adalomo::kPSumsq, p_total, bad, found_inf);
}

template <class P, class G, bool kStochastic>
__global__ void __launch_bounds__(kThreads)
vector_apply_kernel(typename P::T* __restrict__ param, const typename G::T* __restrict__ grad,
                    float* __restrict__ v, const float* __restrict__ ws, int64_t n,
                    int64_t offset, int64_t full_numel, const float* beta2, float eps0,
                    AdalomoStepArgs step_args, AdalomoGradArgs grad_args,
                    LomoRoundingArgs rounding) {
  if (ws[adalomo::kSkip] != 0.0f) return;
  const adalomo::GradScalars s = resolve(grad_args);
  float b, one_minus_b;
  resolve_beta(beta2, b, one_minus_b);
  const adalomo::StepScalars step = resolve_step(step_args, ws, static_cast<float>(full_numel));
  const uint32_t key = kStochastic ? cuda_common::rounding_key(rounding) : 0u;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; k < n;
       k += stride) {
    uint32_t bad;
    const float g = adalomo::grad_g(G::load(grad[k]), s, bad);
    const float v_new = adalomo::moment(v[k], g, b, one_minus_b, eps0);
    v[k] = v_new;
    const float update = __fmul_rn(adalomo::rsqrt_f(v_new), g);
    param[k] = lomo::store_rounded<P, kStochastic>(
        adalomo::apply(P::load(param[k]), update, step), offset + k, key);
  }
}

// ------------------------------------------------------------------------- launch configuration

// Grid of the factored passes: 128-column blocks times row groups, about one wave.
struct FactoredGrid {
  dim3 grid;
  int64_t rows_per_block;
};

FactoredGrid factored_grid(int64_t rows, int64_t cols) {
  const int64_t col_blocks = (cols + kTileCols - 1) / kTileCols;
  const int64_t target = static_cast<int64_t>(cuda_common::sm_count()) * kBlocksPerSm;
  int64_t groups = target / col_blocks;
  groups = groups < 1 ? 1 : groups;
  const int64_t max_groups = (rows + kWarps - 1) / kWarps;
  groups = groups > max_groups ? max_groups : groups;
  int64_t rows_per_block = (rows + groups - 1) / groups;
  groups = (rows + rows_per_block - 1) / rows_per_block;
  if (groups > kMaxGridY) {
    groups = kMaxGridY;
    rows_per_block = (rows + groups - 1) / groups;
    groups = (rows + rows_per_block - 1) / rows_per_block;
  }
  FactoredGrid out;
  out.grid = dim3(static_cast<unsigned>(col_blocks), static_cast<unsigned>(groups), 1);
  out.rows_per_block = rows_per_block;
  return out;
}

unsigned vector_blocks(int64_t n) { return cuda_common::grid_for(n, kThreads, kBlocksPerSm); }

// The required scalar pointers (lr, beta2) must be set: the kernels read them unconditionally.
constexpr int kMissingScalar = static_cast<int>(cudaErrorInvalidValue);

int launch_status(bool dispatched) {
  if (!dispatched) return static_cast<int>(cudaErrorInvalidValue);
  return static_cast<int>(cudaGetLastError());
}

// The rows a slice of n elements at `offset` touches (its grid's rows).
int64_t slice_rows(int64_t cols, int64_t offset, int64_t n) {
  return (offset + n + cols - 1) / cols - offset / cols;
}

}  // namespace

extern "C" {

int adalomo_cuda_factored_stats(const void* grad, int grad_dtype, const void* param,
                                int param_dtype, float* workspace, float* found_inf,
                                const float* skip_if, int64_t rows, int64_t cols,
                                int64_t offset, int64_t n, AdalomoGradArgs grad_args,
                                cudaStream_t stream) {
  if (rows <= 0 || cols <= 0 || n <= 0) return 0;
  const FactoredGrid g = factored_grid(slice_rows(cols, offset, n), cols);
  const MatrixSlice slice{offset, offset + n};
  const bool ok = lomo::dispatch_param_grad(param_dtype, grad_dtype, [&](auto p, auto g_tag) {
    using P = decltype(p);
    using G = decltype(g_tag);
    factored_stats_kernel<P, G><<<g.grid, kThreads, 0, stream>>>(
        static_cast<const typename G::T*>(grad), static_cast<const typename P::T*>(param),
        workspace, found_inf, skip_if, rows, cols, slice, g.rows_per_block, grad_args);
  });
  return launch_status(ok);
}

int adalomo_cuda_factored_moments(float* exp_avg_sq_row, float* exp_avg_sq_col,
                                  float* workspace, int64_t rows, int64_t cols,
                                  const float* beta2, const float* clip_coef, float eps0,
                                  cudaStream_t stream) {
  if (beta2 == nullptr) return kMissingScalar;
  if (rows <= 0 || cols <= 0) return 0;
  const unsigned blocks = static_cast<unsigned>((rows + cols + kThreads - 1) / kThreads);
  factored_moments_kernel<<<blocks, kThreads, 0, stream>>>(
      exp_avg_sq_row, exp_avg_sq_col, workspace, rows, cols, beta2, clip_coef, eps0);
  return launch_status(true);
}

int adalomo_cuda_factored_norm(const void* grad, int grad_dtype, const float* exp_avg_sq_row,
                               const float* exp_avg_sq_col, float* workspace, int64_t rows,
                               int64_t cols, int64_t offset, int64_t n,
                               AdalomoGradArgs grad_args, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0 || n <= 0) return 0;
  const FactoredGrid g = factored_grid(slice_rows(cols, offset, n), cols);
  const MatrixSlice slice{offset, offset + n};
  const bool ok = lomo::dispatch_dtype(grad_dtype, [&](auto g_tag) {
    using G = decltype(g_tag);
    factored_norm_kernel<G><<<g.grid, kThreads, 0, stream>>>(
        static_cast<const typename G::T*>(grad), exp_avg_sq_row, exp_avg_sq_col, workspace,
        rows, cols, slice, g.rows_per_block, grad_args);
  });
  return launch_status(ok);
}

int adalomo_cuda_factored_apply(void* param, int param_dtype, const void* grad, int grad_dtype,
                                const float* exp_avg_sq_row, const float* exp_avg_sq_col,
                                const float* workspace, int64_t rows, int64_t cols,
                                int64_t offset, int64_t n, AdalomoStepArgs step,
                                AdalomoGradArgs grad_args, LomoRoundingArgs rounding,
                                cudaStream_t stream) {
  if (step.lr == nullptr) return kMissingScalar;
  if (rows <= 0 || cols <= 0 || n <= 0) return 0;
  const FactoredGrid g = factored_grid(slice_rows(cols, offset, n), cols);
  const MatrixSlice slice{offset, offset + n};
  const bool ok = lomo::dispatch_write_back(
      param_dtype, grad_dtype, rounding.stochastic != 0, [&](auto p_tag, auto g_tag, auto sr) {
        using P = decltype(p_tag);
        using G = decltype(g_tag);
        factored_apply_kernel<P, G, decltype(sr)::value><<<g.grid, kThreads, 0, stream>>>(
            static_cast<typename P::T*>(param), static_cast<const typename G::T*>(grad),
            exp_avg_sq_row, exp_avg_sq_col, workspace, rows, cols, slice, g.rows_per_block,
            step, grad_args, rounding);
      });
  return launch_status(ok);
}

int adalomo_cuda_vector_stats(const void* grad, int grad_dtype, const void* param,
                              int param_dtype, const float* exp_avg_sq, float* workspace,
                              float* found_inf, const float* skip_if, int64_t n,
                              const float* beta2, float eps0, AdalomoGradArgs grad_args,
                              cudaStream_t stream) {
  if (beta2 == nullptr) return kMissingScalar;
  if (n <= 0) return 0;
  const unsigned blocks = vector_blocks(n);
  const bool ok = lomo::dispatch_param_grad(param_dtype, grad_dtype, [&](auto p, auto g_tag) {
    using P = decltype(p);
    using G = decltype(g_tag);
    vector_stats_kernel<P, G><<<blocks, kThreads, 0, stream>>>(
        static_cast<const typename G::T*>(grad), static_cast<const typename P::T*>(param),
        exp_avg_sq, workspace, found_inf, skip_if, n, beta2, eps0, grad_args);
  });
  return launch_status(ok);
}

int adalomo_cuda_vector_apply(void* param, int param_dtype, const void* grad, int grad_dtype,
                              float* exp_avg_sq, const float* workspace, int64_t n,
                              int64_t offset, int64_t full_numel, const float* beta2,
                              float eps0, AdalomoStepArgs step, AdalomoGradArgs grad_args,
                              LomoRoundingArgs rounding, cudaStream_t stream) {
  if (beta2 == nullptr || step.lr == nullptr) return kMissingScalar;
  if (n <= 0) return 0;
  const unsigned blocks = vector_blocks(n);
  const bool ok = lomo::dispatch_write_back(
      param_dtype, grad_dtype, rounding.stochastic != 0, [&](auto p_tag, auto g_tag, auto sr) {
        using P = decltype(p_tag);
        using G = decltype(g_tag);
        vector_apply_kernel<P, G, decltype(sr)::value><<<blocks, kThreads, 0, stream>>>(
            static_cast<typename P::T*>(param), static_cast<const typename G::T*>(grad),
            exp_avg_sq, workspace, n, offset, full_numel, beta2, eps0, step, grad_args,
            rounding);
      });
  return launch_status(ok);
}

}  // extern "C"
