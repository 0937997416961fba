"""Inductor lowering that realizes pending reads of a weight before the op updating it."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

from ..core import torch_internals

_lowering_patched = False  # `realizing_reads_before_writes` is active (not re-entrant)


@contextlib.contextmanager
def realizing_reads_before_writes() -> Iterator[None]:
    """Inductor lowering in which every pending read of a buffer is realized *before* an op
    that writes the buffer in place, not after it.

    Inductor keeps an elementwise read of a weight (RMSNorm's ``dy * weight``) unrealized, to
    inline it into whichever kernel consumes it. When a fallback kernel then mutates the
    weight (our update ops), ``MutationOutput`` calls ``GraphLowering.mark_buffer_mutated``,
    which realizes those pending reads, but only after the mutating kernel has been
    registered as an operation: the scheduler then orders the realized read after the
    update, and the kernel it is fused into reads the *updated* weight (torch 2.13; seen as
    the final norm's weight read after its update, every gradient below it off by about
    lr * grad / weight, 1e-3 of the update). Here the same realization
    runs just before the op is lowered, so the reads are registered, and scheduled, first.
    It realizes what torch's lowering realizes there anyway, only earlier.
    """
    global _lowering_patched
    if _lowering_patched:
        yield
        return
    lowering = torch_internals.inductor_graph_lowering()
    call_function = lowering.call_function

    @functools.wraps(call_function)
    def realize_then_call(self: Any, target: Any, args: Any, kwargs: Any) -> Any:
        if torch_internals.is_op_overload(target) and torch_internals.op_schema(target).is_mutable:
            users = getattr(self, "name_to_users", {})
            for name in _written_buffers(target, args, kwargs):
                for user in list(users.get(name, ())):
                    user.realize()
        return call_function(self, target, args, kwargs)

    lowering.call_function = realize_then_call
    _lowering_patched = True
    try:
        yield
    finally:
        lowering.call_function = call_function
        _lowering_patched = False


def _written_buffers(target: Any, args: Any, kwargs: Any) -> list[str]:
    """Names of the Inductor buffers that operator overload `target` writes in place, given
    its lowered args."""
    names = []
    for i, argument in enumerate(torch_internals.op_schema(target).arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        if argument.name in kwargs:
            value = kwargs[argument.name]
        elif i < len(args) and not argument.kwarg_only:
            value = args[i]
        else:
            continue
        for item in value if isinstance(value, list | tuple) else (value,):
            get_name = getattr(item, "get_name", None)
            if callable(get_name):
                try:
                    names.append(get_name())
                except (AttributeError, NotImplementedError):
                    continue
    return names
