"""Which backend runs each fused op on each device, and the registration of those kernels.

Every fused op is one `torch.library.custom_op` (its schema, written once in `sgd.py` or
`adalomo.py`) with:
  - the reference (``sgd_reference.py``, ``adalomo_reference.py``) as the implementation
    for any device,
  - a fake implementation (the ops only write into their arguments), so FakeTensor tracing,
    `torch.compile` and `opcheck` see the op without running it,
  - one kernel registered per device type with compiled kernels:
      cpu:  C++ (csrc/*_cpu.cpp), the reference as fallback; Triton only under
            TRITON_INTERPRET=1 (tests),
      cuda: Triton, then the CUDA C++ kernels (csrc/*_cuda.cu), then the reference.
The order is `selection.auto_order`; an explicit ``backend=`` argument or
$LOMO_KERNELS_BACKEND moves one backend first, and one that cannot load is reported once
and skipped (`selection.py`).

Why opaque custom ops and not `torch.library.triton_op` on CUDA: a triton_op decomposes into
its Triton launches under functionalization whatever the device and backend, while these ops
choose among three implementations per device at run time (and the CUDA C++ fallback is not
Triton). Inductor gains no fusion from seeing inside them: each reads a gradient Inductor has
already materialised and writes a graph input in place, one memory-bound pass. What it does
see is the schema's mutation annotations, which is what lets it keep the update in place.

Backend modules (kernels/cpp/*.py, kernels/triton/*.py, the references) provide one function
per op, named as in their family's reference (``sgd_update_``, ``factored_stats_``, ...),
taking the op's arguments in schema order without ``backend``.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from . import adalomo_reference, sgd_reference
from .eager import FusedOp
from .selection import BACKEND_NAMES, ENV_VAR, BackendRegistry, requested_backend

KERNEL_DEVICE_TYPES = ("cpu", "cuda")


def _sgd_triton() -> ModuleType:
    from ..kernels.triton import sgd

    return sgd


def _sgd_cpp() -> ModuleType:
    from ..kernels.cpp import sgd

    return sgd


def _adalomo_triton() -> ModuleType:
    from ..kernels.triton import adalomo

    return adalomo


def _adalomo_cpp() -> ModuleType:
    from ..kernels.cpp import adalomo

    return adalomo


SGD = BackendRegistry("", sgd_reference, {"triton": _sgd_triton, "cpp": _sgd_cpp})
ADALOMO = BackendRegistry(
    "AdaLomo ", adalomo_reference, {"triton": _adalomo_triton, "cpp": _adalomo_cpp}
)


def resolve(device: torch.device, backend: str | None = None) -> ModuleType:
    """The backend module that runs the LOMO update ops on tensors of `device`."""
    return SGD.resolve(device, backend)


def backend_name(module: ModuleType) -> str:
    """Short name ('torch', 'cpp', 'triton') of a backend module of either family."""
    for registry in (SGD, ADALOMO):
        if module.__name__ in registry.names:
            return registry.name_of(module)
    raise KeyError(f"{module.__name__} is not a lomo_kernels backend module")


def _writes_only(*args: Any) -> None:
    """Fake implementation: the ops return nothing and keep every shape."""
    return None


def register_kernels(op: Any, registry: BackendRegistry, function: str) -> FusedOp:
    """Registers the fake and the per-device kernels of `op` (a custom_op whose body is the
    reference). Each kernel runs ``function`` of the backend chosen for the tensors' device;
    the op's last argument is the requested backend name, its first a tensor. Returns the op
    as callers use it: eager calls run that same kernel without the dispatcher (`eager.py`)."""
    op.register_fake(_writes_only)
    kernel = _device_kernel(registry, function)
    for device_type in KERNEL_DEVICE_TYPES:
        op.register_kernel(device_type, kernel)
    return FusedOp(op._opoverload, kernel)


def _device_kernel(registry: BackendRegistry, function: str) -> Callable[..., None]:
    def kernel(*args: Any) -> None:
        *op_args, backend = args
        getattr(registry.resolve(op_args[0].device, backend), function)(*op_args)

    return kernel


__all__ = [
    "ADALOMO",
    "BACKEND_NAMES",
    "ENV_VAR",
    "SGD",
    "backend_name",
    "register_kernels",
    "requested_backend",
    "resolve",
]
