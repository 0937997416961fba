"""Micro-batches and the accumulating loop shared by the accumulation tests
(tests/optim/test_accumulation.py, test_int8_accumulation.py)."""

from __future__ import annotations

import torch

from .models import batch

K = 4
STEPS = 3
# Lomo's fp32 steps against torch.optim.SGD: the suite's bound for that comparison
# (test_lomo_optimizer.py): the buffer sums the micro-batches' gradients in the order torch's
# .grad does, so only the clip coefficient's rounding (a float64 sum here, per-tensor fp32
# norms in clip_grad_norm_) differs, a few fp32 ulps over the run.
FP32_BOUND = 1e-6


def micro_batches(step: int, k: int = K) -> list[dict[str, torch.Tensor]]:
    """Step `step`'s big batch (2k sequences of equal length) cut into k micro-batches."""
    big = batch(step, batch_size=2 * k)
    return [{name: t[2 * i : 2 * i + 2] for name, t in big.items()} for i in range(k)]


def train_accumulating(model, opt, steps=STEPS, k=K):
    for step in range(steps):
        for micro in micro_batches(step, k):
            opt.fused_backward(model(**micro).loss / k)


def piece_of(param, grad, scalars=None, **where):
    """`grad` as a micro-batch hands it to `Accumulation.add`: a piece of `param` (`where`:
    the piece's target, flat offset and shard; `scalars`: the device scalars the measuring
    micro-batch sums into)."""
    from lomo_kernels.optim.device_scalars import DeviceScalars
    from lomo_kernels.optim.piece import Piece

    scalars = DeviceScalars(param.device) if scalars is None else scalars
    return Piece(param, grad, 0, {}, scalars, None, **where)
