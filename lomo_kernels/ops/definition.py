"""Each fused op defined once with `torch.library`, from its `OpSpec` (`core/spec.py`).

An in-place op (the LOMO update, AdaLomo's passes) is a `custom_op` with:
  - the reference (`lomo/reference.py`, `adalomo/reference.py`) as the body for any device,
  - a fake implementation (the ops only write into their arguments), so FakeTensor tracing,
    `torch.compile` and `opcheck` see the op without running it,
  - one kernel registered per dispatch key with compiled kernels, running the backend
    `backends.py` chooses for the device (or the one a public call chose).
The public layer calls it as an `eager.FusedOp`. An op returning tensors (the fused loss,
the embedding backward kept for Inductor) picks its kernels by device itself.

Why opaque custom ops and not `torch.library.triton_op` on CUDA: a triton_op decomposes into
its Triton launches under functionalization whatever the device and backend, while these ops
choose among three implementations per device (and the CUDA C++ fallback is not Triton).
Inductor gains no fusion from seeing inside them: each reads a gradient Inductor has already
materialised and writes a graph input in place, one memory-bound pass. What it does see is
the schema's mutation annotations, which is what lets it keep the update in place.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from ..core.spec import OpSpec
from ..core.torch_internals import custom_op_overload
from .backends import BackendRegistry, chosen_backend
from .eager import FusedOp

KERNEL_DEVICE_TYPES = ("cpu", "cuda")


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
    return FusedOp(spec, custom_op_overload(op, spec.qualname), registry)


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
