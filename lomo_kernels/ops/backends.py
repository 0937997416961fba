"""Which backend runs each fused op on each device, and the definition of the ops.

Every fused op is one `torch.library.custom_op` defined from its `OpSpec` (`spec.py`;
the specs themselves are in `lomo.py` and `adalomo.py`), with:
  - the reference (``lomo_reference.py``, ``adalomo_reference.py``) as the implementation
    for any device,
  - a fake implementation (the ops only write into their arguments), so FakeTensor tracing,
    `torch.compile` and `opcheck` see the op without running it,
  - one kernel registered per dispatch key with compiled kernels, the device's backend:
      cpu:  C++ (csrc/*_cpu.cpp), the reference as fallback; Triton only under
            TRITON_INTERPRET=1 (tests),
      cuda: Triton, then the CUDA C++ kernels (csrc/*_cuda.cu), then the reference.
The order is `selection.auto_order`; $LOMO_KERNELS_BACKEND moves one backend first, and one
that cannot load is reported once and skipped (`selection.py`). No schema carries a backend
name: a caller's ``backend=`` choice is resolved to a backend module by the public layer
(cached per name and device) and runs that module's kernel: directly on the eager fast path,
through the dispatcher otherwise (`eager.py`). Compiled graphs run the device's backend.

Why opaque custom ops and not `torch.library.triton_op` on CUDA: a triton_op decomposes into
its Triton launches under functionalization whatever the device and backend, while these ops
choose among three implementations per device (and the CUDA C++ fallback is not Triton).
Inductor gains no fusion from seeing inside them: each reads a gradient Inductor has already
materialised and writes a graph input in place, one memory-bound pass. What it does see is
the schema's mutation annotations, which is what lets it keep the update in place.

Backend modules (kernels/cpp/*.py, kernels/triton/*.py, the references) provide one function
per op, named by its spec's ``function``, taking the spec's arguments by keyword.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from ..core.spec import OpSpec
from . import adalomo_reference, eager, lomo_reference
from .eager import FusedOp, chosen_backend
from .selection import BACKEND_NAMES, ENV_VAR, BackendRegistry, requested_backend

KERNEL_DEVICE_TYPES = ("cpu", "cuda")


def _lomo_triton() -> ModuleType:
    from ..kernels.triton import lomo

    return lomo


def _lomo_cpp() -> ModuleType:
    from ..kernels.cpp import lomo

    return lomo


def _adalomo_triton() -> ModuleType:
    from ..kernels.triton import adalomo

    return adalomo


def _adalomo_cpp() -> ModuleType:
    from ..kernels.cpp import adalomo

    return adalomo


LOMO = BackendRegistry("", lomo_reference, {"triton": _lomo_triton, "cpp": _lomo_cpp})
ADALOMO = BackendRegistry(
    "AdaLomo ", adalomo_reference, {"triton": _adalomo_triton, "cpp": _adalomo_cpp}
)


def resolve(device: torch.device, backend: str | None = None) -> ModuleType:
    """The backend module that runs the LOMO update ops on tensors of `device`."""
    return LOMO.resolve(device, backend)


def backend_name(module: ModuleType) -> str:
    """Short name ('torch', 'cpp', 'triton') of a backend module of either family."""
    for registry in (LOMO, ADALOMO):
        if module.__name__ in registry.names:
            return registry.name_of(module)
    raise KeyError(f"{module.__name__} is not a lomo_kernels backend module")


def dispatching_to(device: torch.device, backend: str | None) -> contextlib.AbstractContextManager:
    """Within the block, every fused op on `device` that goes through the dispatcher (a
    dispatch mode, opcheck) runs `backend` (a name, as ``backend=``) instead of the device's."""
    return eager.dispatching_to({r: r.resolve(device, backend) for r in (LOMO, ADALOMO)})


def _writes_only(*args: Any, **kwargs: Any) -> None:
    """Fake implementation: the ops return nothing and keep every shape."""
    return None


def define(spec: OpSpec, registry: BackendRegistry) -> FusedOp:
    """Defines the op of `spec`: schema, the reference as its body, the fake, and one kernel
    per dispatch key (the backend `registry` picks for that device). Returns the op as the
    public layer calls it (`eager.FusedOp`)."""
    function = spec.function

    def reference(*args: Any, **kwargs: Any) -> None:
        getattr(registry.reference, function)(**spec.bind(args, kwargs))

    op = torch.library.custom_op(
        spec.qualname, reference, mutates_args=spec.mutated_names, schema=spec.schema()
    )
    op.register_fake(_writes_only)
    for device_type in KERNEL_DEVICE_TYPES:
        op.register_kernel(device_type, _device_kernel(spec, registry, device_type))
    return FusedOp(spec, op._opoverload, registry)


def define_returning(
    spec: OpSpec, implementation: Callable[..., Any], fake: Callable[..., Any]
) -> Any:
    """Defines an op of `spec` that returns tensors (the fused loss's forward and backward):
    the schema from the spec, `implementation` as its body on every device (it picks its
    kernels by device itself), `fake` the tensors it returns. `implementation` takes the
    spec's arguments, name for name; checked here. Returns the custom op."""
    declared = tuple(inspect.signature(implementation).parameters)
    if declared != spec.names:
        raise TypeError(f"{implementation.__name__} takes {declared}, {spec.name} {spec.names}")

    def body(*args: Any, **kwargs: Any) -> Any:
        return implementation(**spec.bind(args, kwargs))

    op = torch.library.custom_op(spec.qualname, body, mutates_args=(), schema=spec.schema())
    op.register_fake(fake)
    return op


def _device_kernel(spec: OpSpec, registry: BackendRegistry, device_type: str) -> Any:
    function = spec.function
    device = torch.device(device_type)

    def kernel(*args: Any, **kwargs: Any) -> None:
        # A public call's backend= choice (eager, through the dispatcher), else the device's.
        module = chosen_backend(registry) or registry.resolve(device)
        getattr(module, function)(**spec.bind(args, kwargs))

    return kernel


__all__ = [
    "ADALOMO",
    "BACKEND_NAMES",
    "ENV_VAR",
    "LOMO",
    "backend_name",
    "define",
    "dispatching_to",
    "requested_backend",
    "resolve",
]
