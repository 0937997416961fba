"""Eager fast path of the fused ops: the chosen backend kernel, called without the dispatcher.

Why: a `torch.library.custom_op` called from Python goes through the dispatcher's Python
layers (autograd, ADInplaceOrView, the backend impl), which cost ~60-150 us of host time
per call, more than the kernel itself takes on a small parameter, and the optimizers call
one op per parameter (AdaLomo: four) inside backward. In plain eager execution those layers
do two things for these ops: bump the version counters of the mutated arguments and run
the kernel registered for the device. `FusedOp.__call__` does exactly that when nothing
else could be listening, and calls the op through the dispatcher otherwise, so
torch.compile, compiled autograd, FakeTensor, functionalization, torch.func transforms,
tensor subclasses, TorchFunction/TorchDispatch modes, the profiler and the JIT tracer all
keep seeing the op.

The public layer calls a `FusedOp` with the caller's backend name and the op's arguments
by keyword; the name is resolved to a backend module (a cached lookup) whose function for
this op runs, on the fast path directly, through the dispatcher under `chosen_backend`.

Autograd stays correct: the ops have no autograd formula, and the fast path is only taken
when autograd would record nothing (grad mode off, or no argument requires grad); the
version bump it does is the one ADInplaceOrView does, before the kernel, for the same
arguments (``mutates_args``), so a tensor saved for backward and then updated is still
detected. Inference tensors have no version counter: `torch._C._increment_version` skips
them, as the dispatcher does.
"""

from __future__ import annotations

import contextlib
import contextvars
import operator
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from .selection import BackendRegistry
    from .spec import OpSpec

_C = torch._C
_PLAIN_TYPES = (torch.Tensor, nn.Parameter)
_FUNCTIONALIZE = _C.DispatchKey.Functionalize

# The backend modules (per op family) a call running now chose, for the device kernels the
# dispatcher runs within it.
_CHOSEN: contextvars.ContextVar[dict[Any, ModuleType] | None] = contextvars.ContextVar(
    "lomo_kernels_backend", default=None
)


def chosen_backend(registry: BackendRegistry) -> ModuleType | None:
    """The backend module of `registry`'s family a call running now chose, if any."""
    chosen = _CHOSEN.get()
    return None if chosen is None else chosen.get(registry)


@contextlib.contextmanager
def dispatching_to(chosen: dict[Any, ModuleType]) -> Iterator[None]:
    """Within the block, the ops of each family in `chosen` (registry -> backend module)
    that reach their CPU/CUDA kernels through the dispatcher run that module's kernel."""
    token = _CHOSEN.set(chosen)
    try:
        yield
    finally:
        _CHOSEN.reset(token)


def _eager(tensors: tuple[Any, ...]) -> bool:
    """Outside Dynamo, True when calling the op would reach its device kernel with nothing in
    between but the version bump: no mode, transform, profiler, tracer or tensor subclass.
    `tensors`: the op's Tensor and Tensor? arguments (None where absent)."""
    if (
        _C._len_torch_dispatch_stack()
        or _C._are_functorch_transforms_active()
        or _C._autograd._profiler_enabled()
        or _C._get_tracing_state() is not None
        or _C._dispatch_tls_is_dispatch_key_included(_FUNCTIONALIZE)
        or _C._has_torch_function(tensors)
    ):
        return False
    # With autograd recording, the op's autograd layer runs: leave it to the dispatcher.
    # (The loop is _C._any_requires_grad over the tensors, at a third of its cost.)
    recording = _C.is_grad_enabled()
    for t in tensors:
        if t is not None and (type(t) not in _PLAIN_TYPES or (recording and t.requires_grad)):
            return False
    return True


class FusedOp:
    """One fused op, called as ``op(backend, **arguments)`` with the spec's arguments.

    Eager: bumps the versions of the mutated tensors and runs the chosen backend's function
    for the op directly, its arguments by position in the spec's order (every backend's
    parameter list is that order: tests/test_op_specs.py), which skips keyword matching in
    the C++ bindings. Otherwise: `overload` through the dispatcher, whose CPU and CUDA
    kernels (`backends.define`) run the same backend function.
    """

    def __init__(self, spec: OpSpec, overload: Any, registry: BackendRegistry) -> None:
        self.spec = spec
        self.overload = overload
        self.registry = registry
        self._function = spec.function
        self._first = spec.names[0]
        positions = {name: i for i, name in enumerate(spec.names)}
        # itemgetter of two or more keys returns a tuple (every op has several tensors).
        self._in_order = operator.itemgetter(*spec.names)
        self._tensors = operator.itemgetter(*(positions[n] for n in spec.tensor_names))
        self._mutated = tuple(positions[n] for n in spec.mutated_names)

    def run_kernel(self, kernel: Callable[..., None], args: tuple[Any, ...]) -> None:
        """The fast path's kernel call: what the dispatcher runs for CPU and CUDA tensors."""
        kernel(*args)

    def _kernel(self, module: ModuleType, device_type: str) -> Callable[..., None]:
        function = getattr(module, self._function)
        # A C++ backend's function finds the extension of its first argument's device: the
        # device is known here, so take the extension's own function.
        for_device = getattr(function, "for_device", None)
        return function if for_device is None else for_device(device_type)

    def __call__(self, backend: str | ModuleType | None, /, **arguments: Any) -> None:
        """`backend`: a name as the public ``backend=`` takes, or a module `self.registry`
        resolved already (a caller running many ops resolves once)."""
        # is_compiling first: Dynamo folds it to True and never traces the rest; a compiled
        # graph runs the device's backend.
        if torch.compiler.is_compiling():
            self.overload(**arguments)
            return
        first = arguments[self._first]
        if not (first.is_cpu or first.is_cuda):  # meta and others: the op's registrations
            self.overload(**arguments)
            return
        device_type = "cuda" if first.is_cuda else "cpu"
        # A name (or None) is resolved here; anything else is a backend resolved already.
        module = (
            self.registry.resolve(first.device, backend)
            if backend is None or isinstance(backend, str)
            else backend
        )
        args = self._in_order(arguments)
        if not _eager(self._tensors(args)):  # modes, transforms, autograd, subclasses
            with dispatching_to({self.registry: module}):
                self.overload(**arguments)
            return
        kernel = self._kernel(module, device_type)
        _C._increment_version(tuple(t for i in self._mutated if (t := args[i]) is not None))
        self.run_kernel(kernel, args)
