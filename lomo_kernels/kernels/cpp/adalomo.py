"""C++ (CPU) and CUDA backend of the AdaLomo passes: torch extensions built on first use.

Same arguments and semantics as `lomo_kernels.ops.adalomo_reference`. Nothing is built at
import time; a failed build is recorded and reported by `unavailable_reason`, never raised,
so the dispatcher can warn once and fall back. torch.utils.cpp_extension caches the build
(keyed by the sources), so later processes only load it.

CPU: `csrc/adalomo_cpu.cpp`. CUDA: `csrc/adalomo_cuda.cu` (kernels and `extern "C"`
launchers, buildable by nvcc alone) plus `csrc/adalomo_cuda_binding.cpp`, which needs a
CUDA build of torch.
"""

from __future__ import annotations

from typing import Any

import torch

from .extension import ExtensionLoader, device_type

_loader = ExtensionLoader(
    "AdaLomo C++ backend",
    cpu=("lomo_kernels_adalomo_cpu", ["adalomo_cpu.cpp"]),
    cuda=("lomo_kernels_adalomo_cuda", ["adalomo_cuda.cu", "adalomo_cuda_binding.cpp"]),
)
is_available = _loader.is_available
unavailable_reason = _loader.unavailable_reason
_module = _loader.module


# Each pass takes the arguments of its `adalomo_reference` function, in the same order, and
# is one kernel launch (CUDA) or one parallel loop (CPU).


def factored_stats_(grad: torch.Tensor, *args: Any) -> None:
    """Pass A: row/column sums of g^2, sums of (grad * inv_scale)^2 and p^2, non-finite flag."""
    _module(device_type(grad)).factored_stats_(grad, *args)


def factored_moments_(exp_avg_sq_row: torch.Tensor, *args: Any) -> None:
    """The row/column moments (clip coefficient and eps0 applied to the means) and sum(R)."""
    _module(device_type(exp_avg_sq_row)).factored_moments_(exp_avg_sq_row, *args)


def factored_norm_(grad: torch.Tensor, *args: Any) -> None:
    """Pass B: sum of update^2."""
    _module(device_type(grad)).factored_norm_(grad, *args)


def factored_apply_(param: torch.Tensor, *args: Any) -> None:
    """Pass C: the write-back."""
    _module(device_type(param)).factored_apply_(param, *args)


def vector_stats_(grad: torch.Tensor, *args: Any) -> None:
    """Pass A1: sum of update^2 and of p^2 of a 1-D tensor."""
    _module(device_type(grad)).vector_stats_(grad, *args)


def vector_apply_(param: torch.Tensor, *args: Any) -> None:
    """Pass C1: the write-back of a 1-D tensor and its second moment."""
    _module(device_type(param)).vector_apply_(param, *args)
