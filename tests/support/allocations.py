"""Dispatch modes that record the largest tensor a step allocates (a logits-free step must
create no tokens x vocabulary or vocabulary x hidden tensor), and a record of the gradients
autograd forms for a weight."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op creates: (elements, shape, op)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest: tuple[int, tuple[int, ...], str] = (0, (), "")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() > self.largest[0]:
                self.largest = (t.numel(), tuple(t.shape), str(func))
        return out


class LargestMatrix(LargestTensor):
    """The largest tensor of two or more dimensions any op but `allowed` allocates (views of
    an input are not allocations; the update kernels' flat fp32 temporaries are 1-D)."""

    def __init__(self, allowed: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.allowed = allowed

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if str(func) in self.allowed:
            return out
        inputs = torch.utils._pytree.tree_leaves((args, kwargs))
        storages = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if (
                isinstance(t, torch.Tensor)
                and t.dim() >= 2
                and t.numel() > self.largest[0]
                and t.untyped_storage().data_ptr() not in storages
            ):
                self.largest = (t.numel(), tuple(t.shape), str(func))
        return out


def formed_gradients(weight: torch.Tensor) -> list[torch.Size]:
    """The shape of every gradient autograd forms for `weight` from now on, as formed (none
    where a fused loss steps the weight from chunks: the hook then sees no gradient). A
    `.grad` read afterwards cannot tell: the in-backward optimizers free each gradient."""
    formed: list[torch.Size] = []
    weight.register_hook(lambda grad: None if grad is None else formed.append(grad.shape))
    return formed
