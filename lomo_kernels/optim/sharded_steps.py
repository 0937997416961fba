"""Routing to the sharding: under ZeRO-3 or FSDP2 the optimizer hands each gradient to its
`Sharding`, takes back batches of this rank's reduced slices and measures or updates them
itself. The sharding never calls the optimizer.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import torch

from ..distributed import ShardGrads, Sharding
from .single_backward import SingleBackwardClip
from .step_mode import Phase, StepMode

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
    scalars: Any  # the device's per-device scalars (lr, flags, the step's clip coefficient)
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


class ShardedSteps:
    """The optimizer's side of sharded training: a base of `InBackwardOptimizer`, which
    provides the step mode, the single-backward rule and the methods used here on single
    tensors too (`_scalars_for`, `_accumulate_norm`, `_note_updated`, `_inv_scale_for`,
    `_skip_if`, `_needs_detection_pass`); subclasses implement `_update_shards`."""

    _sharding: Sharding | None
    _mode: StepMode
    _single_backward_clip: SingleBackwardClip | None
    backend: str | None

    @property
    def _one_loss_per_pass(self) -> bool:
        """Whether each pass needs a forward of its own (ZeRO-3)."""
        return self._sharding is not None and not self._sharding.second_backward_ok

    def _route_to_sharding(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """Hands one gradient to the sharding; steps the batches of slices it returns."""
        for ready in self._sharding.grad_ready(param, grad):
            self._step_shards(ready)

    def _drain_sharding(self) -> None:
        """Steps the batches still pending at the end of backward."""
        for ready in self._sharding.finish():
            self._step_shards(ready)

    def _step_shards(self, ready: ShardGrads) -> None:
        """One batch of this rank's slices with their reduced gradients: measure or update."""
        if not ready:
            return
        scalars = self._scalars_for(ready[0][1].device)
        if self._mode.phase is Phase.NORM:
            for shard, grad in ready:
                self._accumulate_norm(shard.param, grad, scalars)
            return
        for shard, _ in ready:
            self._note_updated(shard.param)
        if self._mode.single_backward:
            # Every rank gets the same per-parameter norms and flags (one small all-reduce),
            # hence the same coefficients and skips (single_backward.py).
            coefs, skips = self._single_backward_clip.prepare_bucket(
                [grad for _, grad in ready],
                self._inv_scale_for(scalars.device),
                self.backend,
                self._sharding.all_reduce_sum_,
            )
            self._update_shards(SliceBatch(ready, scalars, scalars.no_skip, coefs, skips))
        else:
            self._update_shards(SliceBatch(ready, scalars, self._skip_if(scalars)))

    def _check_sharded_pattern(self, loss: torch.Tensor) -> None:
        """Refuses, before any change, a second backward over a ZeRO-3 loss's graph."""
        same_graph = self._mode.same_graph_as_norm(loss)
        missing_norm = (
            not self._mode.norm_ready
            and self._needs_detection_pass()
            and self._single_backward_clip is None
        )
        if same_graph or missing_norm:
            self._mode.forget_norm()
            what = (
                "fused_backward got the loss grad_norm already back-propagated"
                if same_graph
                else "this step needs a norm pass (clip_grad_norm or fp16) before the update"
            )
            raise RuntimeError(f"{what}; {ONE_LOSS_UNDER_SHARDING}")

    @abc.abstractmethod
    def _update_shards(self, batch: SliceBatch) -> None:
        """Applies the step to this rank's slices in `batch`, given their reduced gradients."""
