"""The same training steps with lomo_kernels' optimizers and with lomo-optim's own (the
reference the optimizer tests compare against), on support.models batches."""

from __future__ import annotations

import torch

from support.dependencies import require
from support.models import batch

STEPS = 10
# The option sets compared with lomo-optim.
CONFIGS = {
    "plain": {},
    "weight_decay": {"weight_decay": 0.1},
    "clip_norm": {"clip_grad_norm": 0.5},
    "all": {"weight_decay": 0.1, "clip_grad_norm": 0.5, "clip_grad_value": 0.01},
}


def train(
    cls: type,
    model: torch.nn.Module,
    lr: float,
    steps: int = STEPS,
    call_grad_norm: bool = False,
    **kwargs,
):
    """`steps` steps of `cls(model, lr=lr, **kwargs)`, each `fused_backward(loss, lr)` after
    `grad_norm(loss)` where `call_grad_norm` (lomo-optim's trainer clips that way); returns
    the optimizer."""
    opt = cls(model, lr=lr, **kwargs)
    for step in range(steps):
        loss = model(**batch(step)).loss
        if call_grad_norm:
            opt.grad_norm(loss)
        opt.fused_backward(loss, lr)
    return opt


def train_official(name: str, model: torch.nn.Module, lr: float, steps: int = STEPS, **kwargs):
    """`train` with lomo_optim's optimizer `name` ("Lomo" or "AdaLomo"), measuring the norm
    first when it clips by norm."""
    cls = getattr(require("lomo_optim"), name)
    call_grad_norm = kwargs.get("clip_grad_norm") is not None
    return train(cls, model, lr, steps, call_grad_norm=call_grad_norm, **kwargs)
