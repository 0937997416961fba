"""Stepping a parameter from blocks of its rows' gradients, as a fused op produces them, so
that the parameter's whole gradient never exists (the fused linear + cross-entropy's head:
`ops/cross_entropy/head_gradient.py` walks the vocabulary in chunks, each chunk's gradient
complete when its rows are done).

The op asks `core.gradient_sink` for the weight's sink; the finder registered here asks the
parameter's owner (`core.ownership.owner_of`) for a `RowBlockStep` (a `GradientSink`); None
means "give the parameter its gradient as usual" (the hook then steps it whole). A step is
offered only where it equals the whole-tensor step: an attached `Lomo` (SGD is elementwise;
AdaLomo's statistics span the whole matrix), an eager backward of its own norm or update
pass, and an unsharded parameter registered once in the model (a tied weight gets a second
contribution). A micro-batch of gradient accumulation only adds, which is elementwise for any
optimizer and takes a second contribution too: it takes the blocks of any such parameter,
AdaLomo's and tied weights' included (unsharded, eager).

What each pass does with the blocks:

- norm pass (exact clip by norm, fp16): each block's sum of squares and non-finite flag go
  into the parameter's slot, as its whole gradient's would (the fp32 sum of the blocks'
  fp32 sums: a few ulps of the norm apart from one sum). An overflow anywhere in the head
  is found before any parameter changes, so the update pass leaves every tensor unchanged.
- update pass after a norm pass, or without clipping: each block gets the fused update with
  the step's coefficient and skip flag; elementwise, so the blocks together are the whole
  tensor's update (stochastic rounding: each block is rounded with the bits its elements
  have in the whole tensor, the ops' `offset`).
- single_backward: the coefficient needs the head's whole norm and a non-finite gradient
  leaves the tensor unchanged whole, so the blocks are swept twice: first measured (sum of
  squares and flag, no input gradient), then, with the coefficient and skip flag those give,
  updated. The second sweep recomputes the logits: one more chunked pass of the head's
  matmuls instead of a ``vocab x hidden`` buffer.
- a micro-batch of gradient accumulation (any optimizer: adding is elementwise): each block
  is added into the weight's buffer (`accumulation.py`); the measuring micro-batch takes
  every block, zero ones too, so the buffer's sum of squares covers every row.

A parameter stepped from blocks must get no other gradient in the same pass (it would be a
second step): the second contribution, by blocks or through the hook, is refused with an
error before anything changes: by the norm pass where one precedes the update, otherwise
by the read of the loss's autograd graph before the backward (`loss_graph.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from .. import compile as _compiled_autograd
from .. import ops
from ..core.gradient_sink import register_sink_finder
from ..core.ownership import owner_of
from .head_guard import tied_head_weights
from .piece import Piece
from .single_backward import SingleBackwardClip
from .step import Phase, Step
from .validation import gradient_in_parts_error, parameter_names, second_contribution_error


def row_block_step_for(param: torch.Tensor) -> RowBlockStep | None:
    """The row-block step of `param`'s owning optimizer in the pass in progress, or None
    (no owner, or it takes the whole gradient: see the module docstring)."""
    if torch.compiler.is_compiling():
        return None
    owner = owner_of(param)
    return None if owner is None else owner.row_block_step(param)


register_sink_finder(row_block_step_for)


class RowBlockStep:
    """One parameter's share of the pass in progress, fed block by block: with
    `measure_first`, every block to `measure`, then `measured()`; then every block to
    `apply`, then `finish()`. A block of rows whose gradient is all zero may be left out
    unless `changes_zero_rows`; while `measuring`, `apply` only measures its argument."""

    def __init__(
        self,
        blocks: RowBlocks,
        piece: Piece,
        *,
        inv_scale: torch.Tensor | None,
        changes_zero_rows: bool,
        take: Callable[[Piece], None],
    ) -> None:
        """`blocks`: the pass's row blocks (its step, clip rule and backend); `piece`: the
        parameter's whole piece (its group, device scalars and skip flag), each block taken
        as a piece of its rows; `inv_scale`: the gradients' inverse loss scale;
        `changes_zero_rows`: whether a block whose gradient is zero still counts (decoupled
        weight decay, or a micro-batch measuring its buffers); `take`: the optimizer's
        intake of a piece in the pass in progress."""
        self._blocks, self._piece, self._inv_scale, self._take = blocks, piece, inv_scale, take
        self._width = piece.param.numel() // piece.param.shape[0]
        step = blocks.step
        # A norm pass only measures: any blocks holding the gradient's values will do.
        self.measuring = step.phase is Phase.NORM
        self.measure_first = step.phase is Phase.UPDATE and step.single_backward
        self.changes_zero_rows = changes_zero_rows
        if self.measure_first:
            # [sum of squares, non-finite flag], as SingleBackwardClip.prepare_measured reads.
            self._measured = torch.zeros(2, device=piece.param.device)
            piece.skip_if = self._measured[1:2]

    def measure(self, start: int, stop: int, grad: torch.Tensor) -> None:
        ops.grad_sumsq_(grad, self._measured[0:1], inv_scale=self._inv_scale,
                        found_inf=self._measured[1:2], backend=self._blocks.backend)  # fmt: skip

    def measured(self) -> None:
        """single_backward: the head's coefficient and skip flag from its whole norm."""
        self._blocks.clip.prepare_measured(self._measured, clip_coef=self._piece.scalars.clip_coef)

    def apply(self, start: int, stop: int, grad: torch.Tensor) -> None:
        rows = self._piece.param[start:stop]
        self._take(replace(self._piece, grad=grad, target=rows, offset=start * self._width))

    def finish(self) -> None:
        return None


@dataclass(eq=False)
class RowBlocks:
    """Which parameters the pass in progress may step from blocks of rows, noting on the step
    which it steps so and which got their whole gradient, so that neither gets a second
    contribution. Only an optimizer whose update is elementwise (`steps_rows`) is handed row
    blocks, so rows stepped apart equal the whole tensor's step (Lomo; AdaLomo's statistics
    span the whole matrix)."""

    model: nn.Module
    step: Step
    steps_rows: bool
    sharded: bool  # sharded parameters are never given in rows
    clip: SingleBackwardClip | None
    backend: str | None
    _tied_ids: set[int] | None = field(default=None, init=False)

    def take(self, param: torch.Tensor) -> bool:
        """Whether the pass in progress takes `param`'s gradient in row blocks (see the
        module docstring for when), noting it if so. Refuses a second contribution to a
        parameter already stepped from blocks, or given its whole gradient, in this pass.
        A micro-batch takes any parameter's blocks that can be split (adding is elementwise
        for every optimizer, and a second contribution, a tied weight, is added too)."""
        if self.step.phase is Phase.ACCUMULATE:
            return self._splits(param)
        if self.step.phase is Phase.IDLE or not self.eligible(param):
            return False
        if id(param) in self.step.row_block_params or id(param) in self.step.whole_params:
            raise second_contribution_error(self._name(param))
        self.step.row_block_params.add(id(param))
        return True

    def eligible(self, param: torch.Tensor) -> bool:
        """Whether an update or norm pass takes `param`'s gradient in row blocks where an op
        offers them."""
        return self.steps_rows and id(param) not in self._tied() and self._splits(param)

    def _splits(self, param: torch.Tensor) -> bool:
        """Whether `param`'s gradient may be taken in pieces at all: unsharded and an eager
        backward."""
        if self.sharded or torch.compiler.is_compiling():
            return False
        return not _compiled_autograd.compiled_autograd_active()

    def _tied(self) -> set[int]:
        """Parameters registered under more than one name in the model, or tied to a patched
        model's input embedding (tied weights)."""
        if self._tied_ids is None:
            seen: set[int] = set()
            self._tied_ids = set()
            for _, p in self.model.named_parameters(remove_duplicate=False):
                (self._tied_ids if id(p) in seen else seen).add(id(p))
            # A patched model's head tied to its embedding, where the optimizer was given its
            # parameters (model.parameters() lists a tied weight once).
            self._tied_ids |= tied_head_weights()
        return self._tied_ids

    def _name(self, param: torch.Tensor) -> str:
        return parameter_names(self.model).get(id(param), "?")

    def note_whole_gradient(self, param: torch.Tensor) -> None:
        """The hook got `param`'s whole gradient: refused if blocks stepped it already, or
        if the hook got one already in this pass (the gradient came in parts)."""
        if torch.compiler.is_compiling():
            return  # traced backward: no row blocks there
        if id(param) in self.step.row_block_params:
            raise second_contribution_error(self._name(param))
        # A micro-batch adds each part into the buffer: the parts sum to the gradient. A
        # sharded one is no exception: under ZeRO-3 each part would be reduced and stepped
        # on its own (FSDP2 sums the parts before its reduce, so its hook gets one).
        accumulating = self.step.phase is Phase.ACCUMULATE
        if id(param) in self.step.whole_params and not accumulating:
            raise gradient_in_parts_error(self._name(param))
        self.step.whole_params.add(id(param))
