"""The hooks' lifetime: which parameters carry a live optimizer's post-accumulate-grad hook.

Each trainable parameter gets one hook, attached once the optimizer's whole constructor
succeeded and removed by `detach()` or when the optimizer is collected (the hooks hold it
weakly). A registry of claims refuses a second optimizer on parameters a live one updates,
and tells the compiled-autograd passes which parameters are updated in backward.
"""

from __future__ import annotations

import abc
import weakref
from typing import Any

import torch
from torch import nn


class _Claim:
    """Marks parameters as updated by one optimizer's hooks. A token of its own, so the
    registry below holds no reference to the optimizer."""

    def __init__(self, owner: str) -> None:
        self.owner = owner


# id(parameter) -> (the parameter, weakly; the claim of the optimizer whose hooks it has)
_OWNERS: dict[int, tuple[weakref.ref[torch.Tensor], _Claim]] = {}


def updated_in_backward(t: Any) -> bool:
    """Whether `t` is a parameter that a live in-backward optimizer updates in its hooks."""
    entry = _OWNERS.get(id(t))
    return entry is not None and entry[0]() is t


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

    claim, handles = _Claim(type(optimizer).__name__), []
    ids = [id(p) for p in params]
    try:
        for p in params:
            handles.append(p.register_post_accumulate_grad_hook(on_grad_ready))
            _OWNERS[id(p)] = (weakref.ref(p), claim)
    except BaseException:
        _release(handles, claim, ids)
        raise
    return weakref.finalize(optimizer, _release, handles, claim, ids)


class AttachedAfterInit(abc.ABCMeta):
    """Calls `_attach()` once the whole constructor, the subclass's included, succeeded: a
    constructor that fails leaves the model as it was."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        optimizer = super().__call__(*args, **kwargs)
        optimizer._attach()
        return optimizer
