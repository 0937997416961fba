"""The hooks' lifetime: one post-accumulate-grad hook per trained parameter, attached last in
the optimizer's constructor (one that fails leaves none) together with the optimizer's claim
on its parameters (`core/ownership.py`), and both removed by `detach()` or when the optimizer
is collected (the hooks hold it weakly).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from ..core.ownership import Claim


def _release(handles: list[Any], record: Claim) -> None:
    """Removes one optimizer's hooks and claim (its finalizer: no reference to it)."""
    for handle in handles:
        handle.remove()
    record.release()


def attach_hooks(optimizer: Any, record: Claim, hooked: list[nn.Parameter]) -> weakref.finalize:
    """Holds `optimizer`'s claim `record` and registers a post-accumulate-grad hook on each of
    `hooked` (its parameters, in the param groups' order) that calls
    ``optimizer._on_grad_ready(param)``; returns the finalizer that removes both (run by
    `detach()`, or when `optimizer` is collected). Nothing stays attached if it fails."""
    owner = weakref.ref(optimizer)  # the model must not keep the optimizer alive

    def on_grad_ready(param: torch.Tensor) -> None:
        alive = owner()
        if alive is not None:
            alive._on_grad_ready(param)

    record.hold()
    handles: list[Any] = []
    try:
        for p in hooked:
            handles.append(p.register_post_accumulate_grad_hook(on_grad_ready))
    except BaseException:
        _release(handles, record)
        raise
    return weakref.finalize(optimizer, _release, handles, record)
