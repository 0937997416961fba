"""Where the head's weight gradient goes in the fused loss's backward.

- The weight needs no gradient: its products are skipped (only ``d_hidden`` is computed).
- A live `Lomo` updates the weight in backward and can take it in row blocks
  (`optim/row_blocks.py` says when; the op sees only `core.gradient_sink`): each
  vocabulary chunk's complete gradient is handed to it as soon as it exists, so the
  ``vocab x hidden`` gradient never does; the op returns no gradient for the weight (its
  hook sees nothing, ``weight.grad`` stays None).
  ``single_backward=True`` sweeps the chunks twice: measured first, then updated.
- Otherwise (no in-backward optimizer, AdaLomo, tied or sharded weights, a compiled
  backward): into a ``weight.grad``-shaped buffer that autograd accumulates as usual (so any
  optimizer, AdamW included, sees a normal gradient), built chunk by chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...core.gradient_sink import gradient_sink_for

WholeBackward = Callable[..., tuple[torch.Tensor, torch.Tensor]]
ChunkedBackward = Callable[..., Any]


def head_backward(
    args: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int],
    weight_needs_grad: bool,
    whole_backward: WholeBackward,
    backward_by_chunks: ChunkedBackward,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(d_hidden, d_weight or None) from the backward op's arguments
    ``(grad_loss, hidden, weight, labels, lse, ignore_index)``. The loss's two ways to run
    its backward are passed in: `whole_backward` (both gradients, the weight's in a
    ``weight.grad``-shaped buffer) and `backward_by_chunks` (each chunk's weight gradient
    handed to a sink as it completes)."""
    weight = args[2]
    sink = gradient_sink_for(weight) if weight_needs_grad else None
    if weight_needs_grad and sink is None:
        return whole_backward(*args)
    if sink is None:
        return backward_by_chunks(args, None), None
    if sink.measure_first:
        backward_by_chunks(args, sink.measure, with_d_hidden=False)
        sink.measured()
    d_hidden = backward_by_chunks(args, sink.apply)
    sink.finish()
    return d_hidden, None
