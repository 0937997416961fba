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

Autograd stays correct: the ops have no autograd formula, and the fast path is only taken
when autograd would record nothing (grad mode off, or no argument requires grad); the
version bump it does is the one ADInplaceOrView does, before the kernel, for the same
arguments (``mutates_args``), so a tensor saved for backward and then updated is still
detected. Inference tensors have no version counter: `torch._C._increment_version` skips
them, as the dispatcher does.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

_C = torch._C
_PLAIN_TYPES = (torch.Tensor, nn.Parameter)
_FUNCTIONALIZE = _C.DispatchKey.Functionalize


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
    """One fused op, callable with the op's arguments (the backend name last).

    Eager: bumps the versions of the mutated tensors and runs `device_kernel` (the function
    `backends.register_kernels` registers for the CPU and CUDA dispatch keys) directly.
    Otherwise: `overload` through the dispatcher.
    """

    def __init__(self, overload: Any, device_kernel: Callable[..., None]) -> None:
        self.overload = overload
        arguments = list(overload._schema.arguments)
        tensor_indices = [i for i, a in enumerate(arguments) if "Tensor" in str(a.type)]
        # itemgetter of two or more indices returns a tuple (every op has several tensors).
        self._tensors = operator.itemgetter(*tensor_indices)
        self._mutated_indices = tuple(
            i for i, a in enumerate(arguments) if a.alias_info is not None and a.alias_info.is_write
        )
        self._device_kernel = device_kernel

    def run_kernel(self, *args: Any) -> None:
        """The fast path's kernel call: what the dispatcher runs for CPU and CUDA tensors."""
        self._device_kernel(*args)

    def __call__(self, *args: Any) -> None:
        # is_compiling first: Dynamo folds it to True and never traces the rest.
        if torch.compiler.is_compiling() or not _eager(self._tensors(args)):
            self.overload(*args)
            return
        first = args[0]
        if not (first.is_cpu or first.is_cuda):  # meta and others: the op's registrations
            self.overload(*args)
            return
        mutated = tuple(args[i] for i in self._mutated_indices if args[i] is not None)
        _C._increment_version(mutated)
        self.run_kernel(*args)
