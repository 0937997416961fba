"""Inputs of the fused LOMO update and the float64 bound each backend's result meets
(`support.float64.lomo_update_f64` is the model)."""

from __future__ import annotations

import torch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SIZES = [1, 7, 15, 16, 4097, 278011, 2**20 + 3]
OPTIONS = {
    "plain": {},
    "inv_scale": {"inv_scale": 2.0**-12},
    "clip_value": {"clip_value": 0.5},
    "clip_coef": {"clip_coef": 0.37},
    "weight_decay": {"weight_decay": 0.1},
    "all": {"inv_scale": 2.0**-12, "clip_value": 0.5, "clip_coef": 0.37, "weight_decay": 0.1},
}
LR = 0.05
# fp32 parameters: the fp32 chain rounds up to four times (g*clip_coef, lr*g, p*decay, the
# sum), each by at most half an ulp of the largest operand, so the bound is 2 ulp there.
# bf16/fp16 parameters: the final rounding dominates, 1 ulp at the result.
FP32_ULPS = 2.0


def bound_kwargs(param_dtype: torch.dtype, original: torch.Tensor, lr_g: torch.Tensor) -> dict:
    """`assert_within_ulp`'s bound for a result of `param_dtype`: fp32 results within
    FP32_ULPS of max(|p|, |lr g|), bf16/fp16 ones within 1 ulp of the result."""
    if param_dtype != torch.float32:
        return {}
    return {"scale": torch.maximum(original.double().abs(), lr_g), "ulps": FP32_ULPS}


def make_inputs(
    n: int, param_dtype: torch.dtype, grad_dtype: torch.dtype, *, inv_scale=1.0, seed=0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(param, grad): random values, the gradient scaled as a loss scaler would leave it."""
    gen = torch.Generator().manual_seed(seed + n)
    param = torch.randn(n, generator=gen).to(param_dtype)
    # Scaled gradients, as a loss scaler would produce them, spanning clip_value.
    grad = (torch.randn(n, generator=gen) * 1.5 / inv_scale).to(grad_dtype)
    return param, grad
