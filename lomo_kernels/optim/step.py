"""The step in progress, as one object: its plan (decided once, when the step starts), the
pass that runs, the flags the hooks read, and what the pass has seen.

A step follows one of four plans:

- `Plan.UPDATE`: one update pass, nothing measured first (no clipping by norm, no fp16);
- `Plan.NORM_THEN_UPDATE`: a norm pass measures the gradients (global norm, inf/nan), nothing
  written; the update pass then skips on its overflow flag and clips with its coefficient.
  The norm pass may be the caller's (``grad_norm(loss)``), kept for that loss only;
- `Plan.SINGLE_BACKWARD`: one update pass that clips and checks each gradient as it arrives
  (`single_backward.py`);
- `Plan.ACCUMULATE`: a micro-batch's pass adds each gradient into its buffer; the last
  micro-batch's also measures the sum, and the step is then applied from the buffers
  (`accumulation.py`).

The optimizer keeps one `Step` for its lifetime and starts each step on it (`begin`) rather
than building a new one: the hooks read its fields, and a compiled backward guards on their
values, which stay the same from step to step, where a new object each step would be a new
guard each step. Every reset of the step's state is here: `begin`, `begin_pass`/`end_pass`,
`begin_update`/`end_update` and the norm's `norm_measured`/`forget_norm` (`norm_serves`
and `same_graph_as_norm` only ask).
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


class Plan(enum.Enum):
    UPDATE = "update"
    NORM_THEN_UPDATE = "norm, then update"
    SINGLE_BACKWARD = "single backward"
    ACCUMULATE = "accumulate"


class Phase(enum.Enum):
    IDLE = "idle"  # no backward of the optimizer runs: an arriving gradient is an error
    NORM = "norm"  # gradients are measured (norm, inf/nan), nothing is written
    UPDATE = "update"  # each gradient updates its parameter
    ACCUMULATE = "accumulate"  # each gradient is added into its buffer (accumulation.py)


@dataclass(eq=False)
class Step:
    """The step in progress (see the module docstring). `phase`, `norm_ready` and
    `single_backward` are plain fields, so a compiled backward guards on values."""

    plan: Plan | None = None  # None before the first step
    phase: Phase = Phase.IDLE
    # A norm pass measured this step's loss: the update pass skips on its overflow flag.
    norm_ready: bool = False
    # This update pass clips and checks the gradients as they arrive (no norm pass).
    single_backward: bool = False
    # What the pass in progress has seen: the parameters it updated, in order (an
    # interrupted pass reports them), those it stepped from row blocks and those given their
    # whole gradient (neither may get a second contribution: row_blocks.py).
    updated: list[torch.Tensor] = field(default_factory=list)
    row_block_params: set[int] = field(default_factory=set)
    whole_params: set[int] = field(default_factory=set)
    # The loss scale's setting at the norm pass (`LossScaling.setting`): the norm serves an
    # update pass scaled by the same factor only.
    norm_scale_setting: Any = None
    # The loss the norm pass measured (weakly: a collected loss whose id() is reused never
    # matches), with the clip threshold then and, under sharding, its graph.
    _norm_loss: weakref.ref[torch.Tensor] | None = None
    _norm_max_norm: float | None = None
    _norm_graph: Any = None

    def begin(self, plan: Plan) -> None:
        """Starts a step (or, for `Plan.ACCUMULATE`, a micro-batch) following `plan`."""
        self.plan = plan

    def begin_pass(self, phase: Phase) -> None:
        self.phase = phase
        self.updated.clear()
        self.row_block_params.clear()
        self.whole_params.clear()

    def end_pass(self) -> None:
        self.begin_pass(Phase.IDLE)

    def note_updated(self, param: torch.Tensor) -> None:
        """`param` is being updated by the pass in progress. Noted before the update is
        launched: a failing update counts as applied. Traced (compiled autograd), the append
        would replay only after the graph; not recorded."""
        if not torch.compiler.is_compiling():
            self.updated.append(param)

    # The transitions that keep a reference to the loss are host bookkeeping, kept out of a
    # compiled step (a traced weakref would break the graph and its guards recompile).
    @torch.compiler.disable
    def norm_measured(
        self,
        loss: torch.Tensor,
        max_norm: float | None,
        keep_graph: bool,
        scale_setting: Callable[[], object],
    ) -> None:
        """A norm pass of `loss` with clip threshold `max_norm` completed, at the loss scale
        `scale_setting()` tells (`LossScaling.setting`); `keep_graph`: the graph is
        remembered, to refuse back-propagating it a second time (ZeRO-3)."""
        self.norm_ready = True
        self._norm_loss = weakref.ref(loss)
        self._norm_max_norm = max_norm
        self.norm_scale_setting = scale_setting()
        self._norm_graph = loss.grad_fn if keep_graph else None

    @torch.compiler.disable
    def norm_serves(self, loss: torch.Tensor, max_norm: float | None, same_batch: bool) -> bool:
        """Whether a norm was measured of `loss` with the threshold `max_norm` (`same_batch`:
        any loss counts, the norm pass having had a forward of its own); the loss scale is
        the caller's to compare (`norm_scale_setting`)."""
        return (
            self.norm_ready
            and self._norm_max_norm == max_norm
            and (same_batch or (self._norm_loss is not None and self._norm_loss() is loss))
        )

    def same_graph_as_norm(self, loss: torch.Tensor) -> bool:
        """Whether `loss` is the one whose graph the measured norm's pass back-propagated."""
        return self.norm_ready and loss.grad_fn is self._norm_graph

    @torch.compiler.disable
    def forget_norm(self, scale_setting_too: bool = False) -> None:
        """Drops the measured norm; `scale_setting_too`: its loss scale's setting as well
        (kept otherwise, for the next step to compare: a scale set since the pass starts
        the attempt anew even where the norm itself was dropped)."""
        self.norm_ready = False
        self._norm_loss = None
        self._norm_graph = None
        if scale_setting_too:
            self.norm_scale_setting = None

    def begin_update(self) -> bool:
        """Opens the update pass of the step's plan; returns whether it clips and checks the
        gradients as they arrive (`Plan.SINGLE_BACKWARD`)."""
        self.single_backward = self.plan is Plan.SINGLE_BACKWARD
        return self.single_backward

    @torch.compiler.disable
    def end_update(self) -> bool:
        """Closes the update pass; returns whether a norm pass preceded it."""
        measured = self.norm_ready
        self.forget_norm()
        self.single_backward = False
        return measured
