"""Under ZeRO-3 or FSDP2 the optimizer hands each gradient to its `Sharding` (every
collective is asked of it), takes back batches of this rank's reduced slices and measures
or updates them itself (`piece.PieceBatch`); the sharding never calls the optimizer. What
is left here is the pattern of passes ZeRO-3 allows: one backward per forward.
"""

from __future__ import annotations

import torch

from .step import Step

ONE_LOSS_UNDER_SHARDING = (
    "under ZeRO-3 the graph of a loss cannot be back-propagated twice (DeepSpeed releases the "
    "gathered parameters after the first backward), so the norm pass (clip_grad_norm, or "
    "fp16 overflow detection) needs its own forward: call opt.grad_norm(model(x)) and then "
    "opt.fused_backward(model(x)) with the same batch, once per step"
)


def check_one_loss_pattern(
    step: Step, loss: torch.Tensor, needs_norm_pass: bool, norm_serves: bool
) -> None:
    """Refuses, before any change, a second backward over a ZeRO-3 loss's graph, or an update
    pass missing the norm pass it needs (`needs_norm_pass`; `norm_serves`: whether the
    measured norm serves it); `step`: the step in progress."""
    same_graph = step.same_graph_as_norm(loss)
    if same_graph or (needs_norm_pass and not norm_serves):
        # The measured norm stays: the pattern's own update pass (a forward of its own) may
        # follow the refused call.
        what = (
            "fused_backward got the loss grad_norm already back-propagated"
            if same_graph
            else "this step needs a norm pass (clip_grad_norm or fp16) before the update, at "
            "the step's clip threshold and loss scale"
        )
        raise RuntimeError(f"{what}; {ONE_LOSS_UNDER_SHARDING}")
