// Per-element AdaLomo math shared by the CPU (adalomo_cpu.cpp) and CUDA (adalomo_cuda.cu)
// kernels. Semantics: lomo_kernels/ops/adalomo/reference.py. No torch headers: nvcc
// compiles this alone.
#pragma once

#include <math.h>
#include <stdint.h>

#include "lomo_math.h"

namespace adalomo {

// Workspace slots after the row and column sums (lomo_kernels/ops/adalomo/workspace.py).
enum Slot : int {
  kPSumsq = 0,
  kUSumsq = 1,
  kGSumsq = 2,
  kSkip = 3,
  kRSum = 4,
  kNumSlots = 5
};

using lomo::GradScalars;

// h = grad * inv_scale; bad = 1 when h is inf/nan.
LOMO_HD LOMO_INLINE float scaled_grad(float grad, const GradScalars& s, uint32_t& bad) {
  const float h = lomo::mul_rn(grad, s.inv_scale);
  bad = lomo::is_nonfinite(h);
  return h;
}

// h clamped to [-clip, clip] (the clip coefficient not applied).
LOMO_HD LOMO_INLINE float clamp_grad(float h, const GradScalars& s) {
  h = h < -s.clip ? -s.clip : h;
  return h > s.clip ? s.clip : h;
}

// The fp32 g of the math; bad = 1 when grad * inv_scale is inf/nan.
LOMO_HD LOMO_INLINE float grad_g(float grad, const GradScalars& s, uint32_t& bad) {
  return lomo::mul_rn(clamp_grad(scaled_grad(grad, s, bad), s), s.coef);
}

LOMO_HD LOMO_INLINE float rsqrt_f(float x) {
#if defined(__CUDA_ARCH__)
  return rsqrtf(x);
#else
  return 1.0f / sqrtf(x);
#endif
}

LOMO_HD LOMO_INLINE float max_f(float a, float b) { return a < b ? b : a; }

// (scale, decay) of the final pass from the workspace sums.
struct StepScalars {
  float scale;  // lr_t / max(1, rms(update) / clip_threshold)
  float decay;  // 1 - lr_t * weight_decay
};

LOMO_HD LOMO_INLINE StepScalars step_scalars(const float* stats, float numel, float lr,
                                             float eps1, float clip_threshold,
                                             float weight_decay) {
  const float lr_t = lomo::mul_rn(lr, max_f(sqrtf(stats[kPSumsq] / numel), eps1));
  const float u_rms = sqrtf(stats[kUSumsq] / numel);
  StepScalars out;
  out.scale = lr_t / max_f(u_rms / clip_threshold, 1.0f);
  out.decay = lomo::sub_rn(1.0f, lomo::mul_rn(lr_t, weight_decay));
  return out;
}

// Mean of u = (coef*g)^2 + eps0 from the sum of g^2 over count elements (factored moments):
// coef * (coef * m), since coef is small only when the sums are large and coef*coef alone
// could underflow; coef == 0 gives 0 even for an overflowed (inf) sum.
LOMO_HD LOMO_INLINE float mean_u(float sum_g2, float count, float coef, float eps0) {
  const float m = coef == 0.0f ? 0.0f : sum_g2 / count;
  return lomo::mul_rn(coef, lomo::mul_rn(coef, m)) + eps0;
}

// v_new = b * v + (g*g + eps0) * (1 - b), without contraction (matches the reference).
LOMO_HD LOMO_INLINE float moment(float v, float g, float b, float one_minus_b, float eps0) {
  const float u = lomo::mul_rn(g, g) + eps0;
  return lomo::mul_rn(v, b) + lomo::mul_rn(u, one_minus_b);
}

// p * decay - scale * update, in fp32.
LOMO_HD LOMO_INLINE float apply(float p, float update, const StepScalars& s) {
  return lomo::sub_rn(lomo::mul_rn(p, s.decay), lomo::mul_rn(s.scale, update));
}

}  // namespace adalomo
