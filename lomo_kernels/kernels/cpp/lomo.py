"""C++ CPU and CUDA C++ kernels of the LOMO update ops: torch extensions built on first use.

Same arguments and semantics as `lomo_kernels.ops.sgd_reference`. Nothing is built at import
time; a failed build is recorded (see `unavailable_reason`) and never raises from
`is_available`, so the dispatcher can warn once and fall back.

``LOMO_KERNELS_PREBUILT=1`` imports ``lomo_kernels._C_cpu`` (built by ``setup.py`` with
``LOMO_KERNELS_BUILD_EXT=1``) instead of JIT-building the CPU extension.
"""

from __future__ import annotations

from typing import Any

import torch

from ..._rounding import seed_parts
from .extension import ExtensionLoader, device_type

_loader = ExtensionLoader(
    "C++ backend",
    cpu=("lomo_kernels_cpu", ["lomo_cpu.cpp"]),
    cuda=("lomo_kernels_cuda", ["lomo_cuda.cu", "lomo_cuda_binding.cpp"]),
    prebuilt_cpu="lomo_kernels._C_cpu",
)
is_available = _loader.is_available
unavailable_reason = _loader.unavailable_reason
_module = _loader.module


def sgd_update_(param: torch.Tensor, grad: torch.Tensor, *args: Any) -> None:
    """One fused LOMO step on one contiguous parameter, in place (arguments of
    `sgd_reference.sgd_update_`). The extension takes the host's share of the rounding key
    (`seed_parts`: any int seed, also >= 2**63) and finishes it with seed_step's value."""
    *options, stochastic_rounding, seed, seed_step = args
    # The key only matters where stochastic rounding applies; skip the hash otherwise.
    stochastic = stochastic_rounding and param.dtype == torch.bfloat16
    parts = seed_parts(seed) if stochastic else (0, 0)
    _module(device_type(param)).sgd_update_(
        param, grad, *options, stochastic, *parts, seed_step if stochastic else None
    )


def grad_sumsq_(grad: torch.Tensor, *args: Any) -> None:
    """sumsq += sum((fp32(grad) * inv_scale) ** 2); found_inf = 1 on inf/nan (in place)."""
    _module(device_type(grad)).grad_sumsq_(grad, *args)
