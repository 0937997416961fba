"""Where an op sends a weight's gradient when something steps that weight from pieces.

The fused head (`ops.cross_entropy`) and the used-rows embedding (`ops.embedding`) produce a
weight's gradient block of rows by block. When the weight's owner can take the blocks as
they come (a `Lomo` stepping it in backward), the whole ``rows x width`` gradient never
exists. The ops only know this protocol; the optimizer layer registers the finder that
answers for its parameters (`optim.row_blocks`), so no op imports the optimizers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch


class GradientSink(Protocol):
    """One weight's share of the backward in progress, fed block by block: with
    `measure_first`, every block to `measure`, then `measured()`; then every block to
    `apply`, then `finish()`. A block whose gradient is all zero may be left out unless
    `changes_zero_rows`; while `measuring`, `apply` only measures its argument."""

    measuring: bool
    measure_first: bool
    changes_zero_rows: bool

    def measure(self, start: int, stop: int, grad: torch.Tensor) -> None: ...

    def measured(self) -> None: ...

    def apply(self, start: int, stop: int, grad: torch.Tensor) -> None: ...

    def finish(self) -> None: ...


SinkFinder = Callable[[torch.Tensor], "GradientSink | None"]
_finders: list[SinkFinder] = []


def register_sink_finder(finder: SinkFinder) -> None:
    """Adds `finder` (weight -> its sink or None); registering the same one twice is a no-op."""
    if finder not in _finders:
        _finders.append(finder)


def gradient_sink_for(weight: torch.Tensor) -> GradientSink | None:
    """The sink taking `weight`'s gradient in blocks in this backward, or None: give the
    weight its gradient as usual. Always None while compiling (a traced backward keeps
    autograd's own accumulation)."""
    if torch.compiler.is_compiling():
        return None
    for finder in _finders:
        sink = finder(weight)
        if sink is not None:
            return sink
    return None
