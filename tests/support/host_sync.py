"""A guard that fails on any device-to-host scalar read inside its block, and optimizer
steps run under it."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from support.models import batch, tiny_llama


class NoHostSync(TorchDispatchMode):
    """Fails on any device->host scalar read (.item(), float(t), bool(t))."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            raise AssertionError("host sync inside fused_backward")
        return func(*args, **(kwargs or {}))


def train_without_host_sync(cls: type, dtype: torch.dtype, steps: int = 3, **options):
    """`steps` steps of `cls` (clipping by value 1.0 and decaying 0.01, `options` besides) on
    support.models.tiny_llama in `dtype`, each fused_backward failing on a host sync (the
    forward may sync: only the optimizer's work is guarded); returns (model, optimizer)."""
    model = tiny_llama(dtype)
    opt = cls(model, clip_grad_value=1.0, weight_decay=0.01, **options)
    for step in range(steps):
        loss = model(**batch(step)).loss
        with NoHostSync():
            opt.fused_backward(loss)
    return model, opt
