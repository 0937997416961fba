"""Faults put into a training step: a non-finite element in one parameter's gradient, and
a backward that raises midway."""

from __future__ import annotations

import torch


def poison(param: torch.Tensor, steps_to_poison: set[int], counter: dict[str, int]) -> None:
    """Gradient hook writing an inf into `param`'s gradient on the chosen steps
    (`counter["step"]` says which step runs)."""

    def hook(grad):
        step = counter["step"]
        if step in steps_to_poison:
            grad = grad.clone()
            grad.view(-1)[grad.numel() // 2] = float("inf")
        return grad

    param.register_hook(hook)


class Interrupted(Exception):
    """Raised by a fault put into a backward."""


class FailingBackward(torch.autograd.Function):
    """Identity whose backward calls `fail()` (which raises, or lets the gradient through):
    when it raises, the gradients below it never arrive."""

    @staticmethod
    def forward(ctx, x, fail):
        ctx.fail = fail
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.fail()
        return grad, None
