"""Routing to the sharding: under ZeRO-3 or FSDP2 the optimizer hands each gradient to its
`Sharding`, takes back batches of this rank's reduced slices and measures or updates them
itself (`SliceBatch`). The sharding never calls the optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..distributed import ShardGrads, Sharding
from .device_scalars import DeviceScalars
from .single_backward import SingleBackwardClip
from .step_mode import StepMode

ONE_LOSS_UNDER_SHARDING = (
    "under ZeRO-3 the graph of a loss cannot be back-propagated twice (DeepSpeed releases the "
    "gathered parameters after the first backward), so the norm pass (clip_grad_norm, or "
    "fp16 overflow detection) needs its own forward: call opt.grad_norm(model(x)) and then "
    "opt.fused_backward(model(x)) with the same batch, once per step"
)


@dataclass
class SliceBatch:
    """One batch of this rank's slices to update, and what skips and clips each of them."""

    entries: ShardGrads
    scalars: DeviceScalars  # the slices' device's (lr, flags, the step's clip coefficient)
    skip_if: torch.Tensor  # non-zero: the step is skipped (a norm pass found an overflow)
    # single_backward: entry i's own clip coefficient and skip flag (the same on every rank)
    clip_coefs: torch.Tensor | None = None
    skips: torch.Tensor | None = None

    def skip_of(self, i: int) -> torch.Tensor:
        """Entry i's skip flag, a 1-element tensor."""
        return self.skip_if if self.skips is None else self.skips[i : i + 1]

    def clip_coef_of(self, i: int) -> torch.Tensor:
        """Entry i's clip coefficient, a 1-element tensor (used with clip_grad_norm set)."""
        return self.scalars.clip_coef if self.clip_coefs is None else self.clip_coefs[i : i + 1]


@dataclass(eq=False)
class ShardedSteps:
    """The optimizer's side of sharded training: the `sharding` that reduces the gradients
    (every collective is asked of it), the batches of slices it returns and the pattern of
    passes it allows. Reads the step mode; with single_backward, measures each batch with
    the optimizer's one-backward rule (`clip`)."""

    sharding: Sharding
    mode: StepMode
    clip: SingleBackwardClip | None
    backend: str | None

    @property
    def one_loss_per_pass(self) -> bool:
        """Whether each pass needs a forward of its own (ZeRO-3)."""
        return not self.sharding.second_backward_ok

    def single_backward_batch(
        self, ready: ShardGrads, scalars: DeviceScalars, inv_scale: torch.Tensor | None
    ) -> SliceBatch:
        """`ready` with each entry's clip coefficient and skip flag of the one-backward rule:
        every rank gets the same per-parameter norms and flags (one small all-reduce), hence
        the same coefficients and skips (single_backward.py)."""
        coefs, skips = self.clip.prepare_bucket(
            [grad for _, grad in ready], inv_scale, self.backend, self.sharding.all_reduce_sum_
        )
        return SliceBatch(ready, scalars, scalars.no_skip, coefs, skips)

    def check_pattern(self, loss: torch.Tensor, needs_norm_pass: bool) -> None:
        """Refuses, before any change, a second backward over a ZeRO-3 loss's graph, or an
        update pass missing the norm pass it needs (`needs_norm_pass`)."""
        same_graph = self.mode.same_graph_as_norm(loss)
        missing_norm = not self.mode.norm_ready and needs_norm_pass and self.clip is None
        if same_graph or missing_norm:
            self.mode.forget_norm()
            what = (
                "fused_backward got the loss grad_norm already back-propagated"
                if same_graph
                else "this step needs a norm pass (clip_grad_norm or fp16) before the update"
            )
            raise RuntimeError(f"{what}; {ONE_LOSS_UNDER_SHARDING}")
