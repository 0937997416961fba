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

import torch

from ..core.gradient_sink import gradient_sink_for


def head_backward(
    grad_loss: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    ignore_index: int,
    weight_needs_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(d_hidden, d_weight or None)."""
    from . import cross_entropy as lce

    args = (grad_loss, hidden, weight, labels, lse, ignore_index)
    step = gradient_sink_for(weight) if weight_needs_grad else None
    if weight_needs_grad and step is None:
        return lce._backward_op(*args)
    if step is None:
        return lce.backward_by_chunks(*args, None), None
    if step.measure_first:
        lce.backward_by_chunks(*args, step.measure, with_d_hidden=False)
        step.measured()
    d_hidden = lce.backward_by_chunks(*args, step.apply)
    step.finish()
    return d_hidden, None
