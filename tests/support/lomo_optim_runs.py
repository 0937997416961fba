"""The same training steps with lomo_kernels' optimizers and with lomo-optim's own (the
reference the optimizer tests compare against), on support.models batches."""

from __future__ import annotations

import torch

from support.dependencies import require
from support.float64 import ulp
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


# bf16's relative precision: how far a bf16 forward's gradient may move once the weights it
# reads differ (8 significant bits).
BF16_REL = 2.0**-8


def assert_bf16_parity(ours, official, exact, start) -> None:
    """`ours` trained in bf16 with round-to-nearest write-back against lomo-optim's
    `official` run of the same steps, per element: within one bf16 spacing (at the larger
    of the two) plus ``2^-8 * U``, U the tensor's largest update in the fp32 run `exact`
    (from `start`).

    Why: both round every step's fp32 result to nearest, from the same fp32 math per
    element. Where they differ, fp32 reductions summed in another order (the clip norm,
    AdaLomo's row and column means) moved a result across a rounding boundary: one spacing.
    From then on the two bf16 forwards read different weights, so the later gradients may
    differ by bf16's relative precision, and the later updates by 2^-8 of themselves, which
    add up to at most 2^-8 of the whole run's movement of the tensor (about U)."""
    for (name, a), b, e, s in zip(
        ours.named_parameters(),
        official.parameters(),
        exact.parameters(),
        start.parameters(),
        strict=True,
    ):
        a64, b64 = a.detach().double(), b.detach().double()
        largest_update = (e.detach().double() - s.detach().double()).abs().max()
        assert largest_update > 0, f"{name} never moved in the fp32 run"
        spacing = ulp(torch.maximum(a64.abs(), b64.abs()), torch.bfloat16)
        bound = spacing + BF16_REL * largest_update
        worst = ((a64 - b64).abs() / bound).max().item()
        assert worst <= 1.0, f"{name}: {worst:.3g} times the bound from lomo-optim's run"
