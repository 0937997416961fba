"""Where the head's weight gradient goes in the fused loss's backward.

Today: into a ``weight.grad``-shaped buffer that autograd accumulates as usual (so any
optimizer, AdamW included, sees a normal gradient), built chunk by chunk over the vocabulary.
"""

from __future__ import annotations

import torch


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

    if weight_needs_grad:
        return lce._backward_op(grad_loss, hidden, weight, labels, lse, ignore_index)
    d_hidden = lce.backward_by_chunks(
        grad_loss, hidden, weight, labels, lse, ignore_index, lambda *_: None
    )
    return d_hidden, None
