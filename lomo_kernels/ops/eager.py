"""Eager fast path of the fused ops: the chosen backend kernel, called without the dispatcher.

Why: a `torch.library.custom_op` called from Python goes through the dispatcher's Python
layers (autograd, ADInplaceOrView, the backend impl), which cost ~60-150 us of host time
per call, more than the kernel itself takes on a small parameter, and the optimizers call
one op per parameter (AdaLomo: four) inside backward. In plain eager execution those layers
do two things for these ops: bump the version counters of the mutated arguments and run
the kernel registered for the device. A `FusedOp` call does exactly that when nothing
else could be listening, and calls the op through the dispatcher otherwise, so
torch.compile, compiled autograd, FakeTensor, functionalization, torch.func transforms,
tensor subclasses, TorchFunction/TorchDispatch modes, the profiler and the JIT tracer all
keep seeing the op.

The public layer calls a `FusedOp` with the caller's backend name and the op's arguments
by keyword (Lomo's per-tensor update: `FusedOp.call_in_order`, the arguments as a tuple in
the spec's order; AdaLomo's passes: a `FusedSequence`, several ops on one set of arguments,
checked once for all of them); the name is resolved to a backend module (a cached lookup) whose
function for this op runs, on the fast path directly, through the dispatcher under
`chosen_backend`. What each fast call checks is the least that proves nothing else could
see the op: a few reads of this thread's state, the exact types of the tensor arguments,
and autograd's grad mode; everything else it needs is cached per op and device type.

Autograd stays correct: the ops have no autograd formula, and the fast path is only taken
when autograd would record nothing (grad mode off, or no argument requires grad); the
version bump it does is the one ADInplaceOrView does, before the kernel, for the same
arguments (``mutates_args``), so a tensor saved for backward and then updated is still
detected. Inference tensors have no version counter: the version bump skips them, as the
dispatcher does.

The thread-state reads and the version bump are torch internals
(`core.torch_internals.dispatcher_bypass`): on a torch that lacks any of them, every call
goes through the dispatcher.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..core.torch_internals import dispatcher_bypass
from .backends import BackendRegistry, dispatching_to_modules

if TYPE_CHECKING:
    from ..core.spec import OpSpec

# What an eager call reads each time, bound once: attribute lookups on torch's modules are
# a measurable part of a call's host time.
_is_compiling = torch.compiler.is_compiling
_is_grad_enabled = torch.is_grad_enabled
_given = functools.partial(operator.is_not, None)  # an optional argument that is not None
# The exact types of a Tensor? argument the fast path takes (a subclass, even one without
# `__torch_function__` such as DTensor, may dispatch on its own).
_PLAIN_OR_ABSENT = frozenset((torch.Tensor, nn.Parameter, type(None)))


def _nothing_listening() -> bool:
    """Whether this thread's state lets an op called now reach its device kernel with
    nothing in between: no TorchFunction or TorchDispatch mode, torch.func transform,
    profiler, JIT tracer or functionalization (never, on a torch where that cannot be read)."""
    return dispatcher_bypass().nothing_listening()


def _plain_unrecorded(tensors: tuple[Any, ...]) -> bool:
    """Whether `tensors` (the op's Tensor and Tensor? arguments, None where absent) are
    plain tensors or Parameters that autograd does not record. Their exact types also mean
    no `__torch_function__` of a subclass: only a mode could intercept them, and
    `_nothing_listening` looks for those."""
    if not _PLAIN_OR_ABSENT.issuperset(map(type, tensors)):
        return False
    # With autograd recording, the op's autograd layer runs: leave it to the dispatcher.
    return not (_is_grad_enabled() and dispatcher_bypass().any_requires_grad(*tensors))


def _kernel_device_type(tensor: torch.Tensor) -> str | None:
    """'cuda' or 'cpu', the device types the fast path runs kernels on; None for meta and
    others (their calls go to the op's registrations)."""
    if tensor.is_cuda:
        return "cuda"
    return "cpu" if tensor.is_cpu else None


def _tuple_of(positions: tuple[int, ...]) -> Callable[[tuple[Any, ...]], tuple[Any, ...]]:
    """The items of a tuple at `positions`, as a tuple (itemgetter of a single key returns
    the item itself: that one is taken as a slice)."""
    if len(positions) == 1:
        return operator.itemgetter(slice(positions[0], positions[0] + 1))
    return operator.itemgetter(*positions)


class FusedOp:
    """One fused op, called as ``op(backend, **arguments)`` with the spec's arguments, or as
    ``op.call_in_order(backend, args)`` with them as a tuple in the spec's order.

    Eager: bumps the versions of the mutated tensors and runs the chosen backend's function
    for the op directly, its arguments by position in the spec's order (every backend's
    parameter list is that order: tests/ops/test_op_specs.py), which skips keyword matching in
    the C++ bindings. Otherwise: `overload` through the dispatcher, whose CPU and CUDA
    kernels (`definition.define`) run the same backend function.
    """

    def __init__(self, spec: OpSpec, overload: Any, registry: BackendRegistry) -> None:
        self.spec = spec
        self.overload = overload
        self.registry = registry
        self._function = spec.function
        self._names = spec.names
        positions = {name: i for i, name in enumerate(spec.names)}
        self._in_order = operator.itemgetter(*spec.names)
        self._tensors = _tuple_of(tuple(positions[n] for n in spec.tensor_names))
        self._mutated = _tuple_of(tuple(positions[n] for n in spec.mutated_names))
        # Per device type: the backend function last seen and the kernel it runs there.
        self._kernels: dict[str, tuple[Callable[..., None], Callable[..., None]]] = {}

    def _kernel(self, module: ModuleType, device_type: str) -> Callable[..., None]:
        """The fast path's kernel: what the dispatcher runs for CPU and CUDA tensors."""
        function = getattr(module, self._function)
        cached = self._kernels.get(device_type)
        if cached is not None and cached[0] is function:
            return cached[1]
        # A C++ backend's function finds the extension of its first argument's device: the
        # device is known here, so take the extension's own function.
        for_device = getattr(function, "for_device", None)
        kernel = function if for_device is None else for_device(device_type)
        self._kernels[device_type] = (function, kernel)
        return kernel

    def __call__(self, backend: str | ModuleType | None, /, **arguments: Any) -> None:
        """`backend`: a name as the public ``backend=`` takes, or a module `self.registry`
        resolved already (a caller running many ops resolves once)."""
        self.call_from(backend, arguments)

    def call_from(self, backend: str | ModuleType | None, arguments: dict[str, Any]) -> None:
        """As ``op(backend, **arguments)``, this op's arguments taken by name out of
        `arguments`, which may hold other ops' too (a caller running several ops on one set)."""
        # is_compiling first: Dynamo folds it to True and never traces the rest (it cannot
        # trace an itemgetter); a compiled graph runs the device's backend.
        if _is_compiling():
            self.overload(**{name: arguments[name] for name in self._names})
            return
        self._call_eager(backend, self._in_order(arguments))

    def call_in_order(self, backend: str | ModuleType | None, args: tuple[Any, ...]) -> None:
        """As ``op(backend, **arguments)``, the arguments given as a tuple in the spec's order
        (``spec.names``): for a caller that makes many calls and builds them so."""
        if _is_compiling():
            self._dispatch(args)
            return
        self._call_eager(backend, args)

    def _call_eager(self, backend: str | ModuleType | None, args: tuple[Any, ...]) -> None:
        """`call_in_order` outside tracing."""
        first = args[0]
        device_type = _kernel_device_type(first)
        if device_type is None:
            self._dispatch(args)
            return
        # A name (or None) is resolved here; anything else is a backend resolved already.
        module = (
            self.registry.resolve(first.device, backend)
            if backend is None or isinstance(backend, str)
            else backend
        )
        # Modes, transforms, profiler, tracer, subclasses, autograd: the dispatcher.
        if not (_nothing_listening() and _plain_unrecorded(self._tensors(args))):
            with dispatching_to_modules({self.registry: module}):
                self._dispatch(args)
            return
        self._run_kernel(module, device_type, args)

    def _run_kernel(self, module: ModuleType, device_type: str, args: tuple[Any, ...]) -> None:
        """The fast path itself, once `_nothing_listening` and `_plain_unrecorded` allow it:
        the dispatcher's version bump, then the backend's kernel."""
        kernel = self._kernel(module, device_type)
        dispatcher_bypass().increment_version(filter(_given, self._mutated(args)))
        kernel(*args)

    def _dispatch(self, args: tuple[Any, ...]) -> None:
        """The call through the dispatcher, the arguments by name (as the public layer gives
        them, in the spec's order)."""
        self.overload(**dict(zip(self._names, args, strict=True)))


class FusedSequence:
    """Ops of one family run one after another on one set of arguments by name (AdaLomo's
    passes of one parameter), each as `FusedOp.call_from` runs it; eager, with a backend
    module resolved already, the fast path's checks (thread state, the exact types and grad
    mode of every tensor any of the ops takes) are made once for the whole sequence: nothing
    between the ops changes them (`between` runs only tensor ops of the library's own)."""

    def __init__(self, *ops: FusedOp) -> None:
        self.ops = ops
        tensor_names = dict.fromkeys(name for op in ops for name in op.spec.tensor_names)
        self._first = ops[0].spec.names[0]
        self._tensors = operator.itemgetter(*tensor_names)

    def __call__(
        self,
        backend: str | ModuleType | None,
        arguments: dict[str, Any],
        between: Callable[[], None] | None = None,
    ) -> None:
        """Runs the ops in order; `between` (if given) after the first."""
        # is_compiling first, as in FusedOp.call_from.
        device_type = None if _is_compiling() else self._fast_device_type(backend, arguments)
        for index, op in enumerate(self.ops):
            if device_type is None:
                op.call_from(backend, arguments)
            else:
                op._run_kernel(backend, device_type, op._in_order(arguments))
            if index == 0 and between is not None:
                between()

    def _fast_device_type(
        self, backend: str | ModuleType | None, arguments: dict[str, Any]
    ) -> str | None:
        """The device type whose kernels every op runs directly, if each may take the fast
        path (a resolved backend module, nothing listening, plain unrecorded tensors); else
        None: each op decides for itself, as `FusedOp.call_from` does."""
        device_type = _kernel_device_type(arguments[self._first])
        if (
            device_type is None
            or backend is None
            or isinstance(backend, str)
            or not (_nothing_listening() and _plain_unrecorded(self._tensors(arguments)))
        ):
            return None
        return device_type
