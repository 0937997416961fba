"""The hooks' lifetime: which parameters carry a live optimizer's post-accumulate-grad hook.

Each trainable parameter gets one hook, attached last in the optimizer's constructor (one
that fails leaves none) and removed by `detach()` or when the optimizer is collected (the
hooks hold it weakly). A registry of claims refuses a second optimizer on parameters a live
one updates, tells the compiled-autograd passes which parameters are updated in backward,
and tells a fused op producing a gradient in blocks which optimizer to hand them to
(`owner_of`).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn


class _Claim:
    """Marks parameters as updated by one optimizer's hooks. A token of its own holding the
    optimizer weakly, so the registry below does not keep it alive."""

    def __init__(self, optimizer: Any) -> None:
        self.owner = type(optimizer).__name__
        self.optimizer = weakref.ref(optimizer)


# id(parameter) -> (the parameter, weakly; the claim of the optimizer whose hooks it has)
_OWNERS: dict[int, tuple[weakref.ref[torch.Tensor], _Claim]] = {}


def updated_in_backward(t: Any) -> bool:
    """Whether `t` is a parameter that a live in-backward optimizer updates in its hooks."""
    entry = _OWNERS.get(id(t))
    return entry is not None and entry[0]() is t


def owner_of(t: Any) -> Any:
    """The live in-backward optimizer whose hooks update parameter `t`, or None (a fused op
    that produces `t`'s gradient in blocks hands them to it: `row_blocks.py`)."""
    if not updated_in_backward(t):
        return None
    return _OWNERS[id(t)][1].optimizer()


def check_unowned(params: list[nn.Parameter], names: dict[int, str], new_owner: str) -> None:
    """Refuses parameters that a live in-backward optimizer already updates: both would
    update them in the same backward."""
    for p in params:
        if updated_in_backward(p):
            entry = _OWNERS[id(p)]
            raise ValueError(
                f"parameter {names.get(id(p), '?')!r} is already updated in backward by a live "
                f"{entry[1].owner}: call .detach() on that optimizer (or build it in a with "
                f"block) before building a {new_owner} on the same parameters"
            )


def _release(handles: list[Any], claim: _Claim, ids: list[int]) -> None:
    """Removes one optimizer's hooks and claims (its finalizer: no reference to it)."""
    for handle in handles:
        handle.remove()
    for i in ids:
        entry = _OWNERS.get(i)
        if entry is not None and entry[1] is claim:
            del _OWNERS[i]


def attach_hooks(optimizer: Any, params: list[nn.Parameter]) -> weakref.finalize:
    """Registers a post-accumulate-grad hook on each parameter that calls
    ``optimizer._on_grad_ready(param)``, and claims the parameters; returns the finalizer
    that removes both (run by `detach()`, or when `optimizer` is collected). Nothing stays
    attached if it fails."""
    owner = weakref.ref(optimizer)  # the model must not keep the optimizer alive

    def on_grad_ready(param: torch.Tensor) -> None:
        alive = owner()
        if alive is not None:
            alive._on_grad_ready(param)

    claim, handles = _Claim(optimizer), []
    ids = [id(p) for p in params]
    try:
        for p in params:
            handles.append(p.register_post_accumulate_grad_hook(on_grad_ready))
            _OWNERS[id(p)] = (weakref.ref(p), claim)
    except BaseException:
        _release(handles, claim, ids)
        raise
    return weakref.finalize(optimizer, _release, handles, claim, ids)
