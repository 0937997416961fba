"""C++ (CPU) and CUDA backend: torch extensions built from ``csrc/`` on first use.

Same signatures and semantics as :mod:`lomo_kernels.backends.reference`. Nothing is built
at import time; a failed build is recorded (see :func:`unavailable_reason`) and never raises
from :func:`is_available`, so the dispatcher can warn once and fall back.

``LOMO_KERNELS_PREBUILT=1`` imports ``lomo_kernels._C_cpu`` (built by ``setup.py`` with
``LOMO_KERNELS_BUILD_EXT=1``) instead of JIT-building the CPU extension.
"""

from __future__ import annotations

import torch

from .._extension import ExtensionLoader
from .._rounding import seed_key

_loader = ExtensionLoader(
    "C++ backend",
    cpu=("lomo_kernels_cpu", ["lomo_cpu.cpp"]),
    cuda=("lomo_kernels_cuda", ["lomo_cuda.cu", "lomo_cuda_binding.cpp"]),
    native=True,
    prebuilt_cpu="lomo_kernels._C_cpu",
)
is_available = _loader.is_available
unavailable_reason = _loader.unavailable_reason
_module = _loader.module


def _device_type(t: torch.Tensor) -> str:
    # Tensor.is_cuda is several times cheaper than Tensor.device.type (per-call overhead).
    return "cuda" if t.is_cuda else ("cpu" if t.is_cpu else t.device.type)


def sgd_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    *,
    lr: float,
    lr_tensor: torch.Tensor | None,
    inv_scale: float,
    inv_scale_tensor: torch.Tensor | None,
    clip_value: float | None,
    clip_coef: float,
    clip_coef_tensor: torch.Tensor | None,
    weight_decay: float,
    found_inf: torch.Tensor | None,
    skip_if: torch.Tensor | None,
    stochastic_rounding: bool,
    seed: int,
) -> None:
    """One fused LOMO step on one contiguous parameter, in place (see reference.sgd_update_)."""
    # The key only matters where stochastic rounding applies; skip the hash otherwise.
    key = seed_key(seed) if stochastic_rounding and param.dtype == torch.bfloat16 else 0
    _module(_device_type(param)).sgd_update_(
        param,
        grad,
        float(lr),
        lr_tensor,
        float(inv_scale),
        inv_scale_tensor,
        None if clip_value is None else float(clip_value),
        float(clip_coef),
        clip_coef_tensor,
        float(weight_decay),
        found_inf,
        skip_if,
        bool(stochastic_rounding),
        key,
    )


def grad_sumsq_(
    grad: torch.Tensor,
    *,
    inv_scale: float,
    inv_scale_tensor: torch.Tensor | None,
    sumsq: torch.Tensor,
    found_inf: torch.Tensor | None,
) -> None:
    """sumsq += sum((fp32(grad) * inv_scale) ** 2); found_inf = 1 on inf/nan (in place)."""
    _module(_device_type(grad)).grad_sumsq_(
        grad, float(inv_scale), inv_scale_tensor, sumsq, found_inf
    )
