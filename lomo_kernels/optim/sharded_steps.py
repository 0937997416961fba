"""Routing to the sharding: under ZeRO-3 or FSDP2 the optimizer hands each gradient to its
`Sharding`, takes back batches of this rank's reduced slices and measures or updates them
itself (`piece.PieceBatch`). The sharding never calls the optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..distributed import ShardGrads, Sharding
from .single_backward import SingleBackwardClip
from .step import Step

ONE_LOSS_UNDER_SHARDING = (
    "under ZeRO-3 the graph of a loss cannot be back-propagated twice (DeepSpeed releases the "
    "gathered parameters after the first backward), so the norm pass (clip_grad_norm, or "
    "fp16 overflow detection) needs its own forward: call opt.grad_norm(model(x)) and then "
    "opt.fused_backward(model(x)) with the same batch, once per step"
)


@dataclass(eq=False)
class ShardedSteps:
    """The optimizer's side of sharded training: the `sharding` that reduces the gradients
    (every collective is asked of it), the batches of slices it returns and the pattern of
    passes it allows. Reads the step in progress; with single_backward, measures each batch with
    the optimizer's one-backward rule (`clip`)."""

    sharding: Sharding
    step: Step
    clip: SingleBackwardClip | None
    backend: str | None

    @property
    def one_loss_per_pass(self) -> bool:
        """Whether each pass needs a forward of its own (ZeRO-3)."""
        return not self.sharding.second_backward_ok

    def single_backward_flags(
        self, ready: ShardGrads, inv_scale: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Each entry of `ready`'s clip coefficient (None with clipping off) and skip flag by
        the one-backward rule: every rank gets the same per-parameter norms and flags (one
        small all-reduce), hence the same coefficients and skips (single_backward.py)."""
        return self.clip.prepare_bucket(
            [grad for _, grad in ready], inv_scale, self.backend, self.sharding.all_reduce_sum_
        )

    def check_pattern(self, loss: torch.Tensor, needs_norm_pass: bool) -> None:
        """Refuses, before any change, a second backward over a ZeRO-3 loss's graph, or an
        update pass missing the norm pass it needs (`needs_norm_pass`)."""
        same_graph = self.step.same_graph_as_norm(loss)
        missing_norm = not self.step.norm_ready and needs_norm_pass and self.clip is None
        if same_graph or missing_norm:
            self.step.forget_norm()
            what = (
                "fused_backward got the loss grad_norm already back-propagated"
                if same_graph
                else "this step needs a norm pass (clip_grad_norm or fp16) before the update"
            )
            raise RuntimeError(f"{what}; {ONE_LOSS_UNDER_SHARDING}")
