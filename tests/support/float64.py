"""Independent float64 model of the LOMO update and the ulp bounds the kernels must meet."""

from __future__ import annotations

import math

import torch

U32 = 2.0**-24  # unit roundoff of fp32: one rounding moves a value by at most U32 * |value|
# Our gradient norm against one torch (or lomo_optim) takes in fp32 of the same gradients:
# torch adds each tensor's squares in a cascade (~log2(n) + vector-lane roundings, under 32 on
# any ISA for the test models' tensors of <= a few thousand elements), then the norm of the
# norms; ours sums each tensor in float64. Relative difference within 64 u (seen: <= 4 u).
FP32_NORM_RTOL = 64 * U32
MANTISSA_BITS = {torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}
MIN_EXPONENT = {torch.float32: -126, torch.float16: -14, torch.bfloat16: -126}


def as_f32(x: float) -> float:
    """The fp32 value a kernel sees for a Python float argument."""
    return torch.tensor(x, dtype=torch.float32).item()


def lomo_update_f64(
    param, grad, *, lr, inv_scale=1.0, clip_value=None, clip_coef=None, weight_decay=0.0
):
    """(new param in float64, mask of non-finite gradient elements, float64 lr*g magnitude)."""
    lr = as_f32(lr)
    g = grad.double().reshape(-1) * as_f32(inv_scale)
    bad = ~torch.isfinite(g)
    if clip_value is not None:
        cv = as_f32(clip_value)
        g = g.clamp(-cv, cv)
    if clip_coef is not None:
        g = g * as_f32(clip_coef)
    p = param.double().reshape(-1)
    decay = as_f32(1.0 - lr * as_f32(weight_decay)) if weight_decay else 1.0
    new = p * decay - lr * g
    return new, bad, (lr * g).abs()


def ulp(magnitude: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Unit in the last place of `dtype` at float64 `magnitude` (subnormal floor included)."""
    bits = MANTISSA_BITS[dtype]
    _, exponent = torch.frexp(magnitude.abs().clamp_min(1e-300))
    exponent = torch.clamp(exponent.to(torch.float64) - 1, min=MIN_EXPONENT[dtype])
    return torch.pow(2.0, exponent - (bits - 1))


def assert_within_ulp(out, ref64, dtype, *, scale=None, ulps=1.0, mask=None):
    """|out - ref| <= ulps * ulp(dtype) at max(|ref|, scale), elementwise where mask holds."""
    out64 = out.double().reshape(-1)
    magnitude = ref64.abs() if scale is None else torch.maximum(ref64.abs(), scale)
    bound = ulps * ulp(magnitude, dtype)
    err = (out64 - ref64).abs()
    ok = err <= bound
    if mask is not None:
        ok = ok | ~mask
    if not bool(ok.all()):
        i = int((~ok).nonzero()[0])
        raise AssertionError(
            f"{int((~ok).sum())} elements beyond {ulps} ulp; first at {i}: "
            f"out={out64[i].item()!r} ref={ref64[i].item()!r} bound={bound[i].item()!r}"
        )


def sumsq_rel_bound(backend: str, n: int) -> float:
    """Worst-case relative error of `grad_sumsq_` on n positive terms, by how it adds.

    A sum of positive terms through a chain of k fp32 additions is within k * u (u = 2^-24)
    of the exact value (plus O(k^2 u^2)). The torch and cpp backends sum in float64 and
    round once, then add into sumsq: 2 roundings. Triton sums each BLOCK in a tree
    (log2(BLOCK) levels), then adds one partial per program with an fp32 atomic: one chain
    of ceil(n / BLOCK) additions, plus the tail's and the final one. Squaring and scaling
    each term in fp32 adds 2 roundings per term (relative, so they add 2u overall). Relative
    only for squares in fp32's normal range (every test's values): on the fp32 backends
    (Triton, CUDA) a square below 2^-126 is subnormal, within 2^-150 absolute (docs/ops.md).
    """
    if backend == "triton":
        from lomo_kernels.ops.lomo.triton_backend import BLOCK

        chain = math.log2(BLOCK) + math.ceil(n / BLOCK) + 2
    else:
        chain = 2
    return (chain + 2) * U32 * 1.01
