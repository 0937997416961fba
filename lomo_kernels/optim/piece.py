"""A piece of one parameter's step: the one form in which every route hands a gradient to
the pass in progress (the update, the norm pass's accumulator, a micro-batch's buffer).

A gradient arrives in one of three ways, each a `Piece`: the whole tensor (the
post-accumulate-grad hook), a block of its rows as a fused op produces them
(`row_blocks.py`) or this rank's reduced slice of it (ZeRO-3, FSDP2: `distributed/`);
the step from accumulated gradients hands the update each buffer (`accumulation.py`) as the
whole tensor's or the slice's piece. A piece says what is written (`target`, with its flat
offset in the parameter, which keys its stochastic rounding and places it in the buffer),
from which gradient, with which group's hyper-parameters and device scalars, what skips it
and which clip coefficient scales it. An elementwise update (Lomo) steps any piece on its
own; AdaLomo's statistics span a whole matrix, so it takes whole tensors one by one and this
rank's slices as one `PieceBatch`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..distributed import Shard
from .device_scalars import DeviceScalars
from .int8_buffer import Int8Buffer


@dataclass
class Piece:
    """One parameter's part of the pass in progress (see the module docstring)."""

    param: torch.Tensor  # the parameter (its optimizer state and rounding seed are its own)
    # The gradient of `target`, or its 8-bit accumulation buffer (an optimizer that
    # `reads_int8_buffers`).
    grad: torch.Tensor | Int8Buffer
    group_index: int  # the lr is the device tensor scalars.lr[group_index]
    group: dict[str, Any]  # the param group's hyper-parameters without "params" and "lr"
    scalars: DeviceScalars  # those of the target's device
    # Non-zero: nothing is written. None: the update measures the gradient itself and calls
    # on_grad_sumsq with its [sum of squares, non-finite flag] before reading
    # scalars.clip_coef, skipping a non-finite gradient itself (`_update_measures`).
    skip_if: torch.Tensor | None
    on_grad_sumsq: Callable[[torch.Tensor], None] | None = None
    # What is written: None for the whole parameter, else a block of its rows or this rank's
    # slice, starting at flat element `offset` of the parameter.
    target: torch.Tensor | None = None
    offset: int = 0
    # The piece's own clip coefficient (a single_backward slice's); None: scalars.clip_coef.
    clip_coef: torch.Tensor | None = None
    shard: Shard | None = None  # this rank's slice, under sharding

    @property
    def written(self) -> torch.Tensor:
        """The tensor the update writes."""
        return self.param if self.target is None else self.target


@dataclass
class PieceBatch:
    """This rank's slices of one batch of parameters, stepped together (sharded training):
    the same parameters in the same order on every rank."""

    pieces: list[Piece]
    scalars: DeviceScalars  # the slices' device's
    skip_if: torch.Tensor  # non-zero: the step is skipped (a norm pass found an overflow)
