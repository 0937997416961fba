"""The mode of the step in progress: which pass runs, and how the update pass treats each
gradient. One object, changed only through its named transitions.

A step is either one update pass, or a norm pass (gradients measured, nothing written)
followed by an update pass that skips on the norm pass's overflow flag and clips with its
coefficient. With ``single_backward=True`` the update pass clips and checks each gradient
as it arrives instead (`single_backward.py`).
"""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass
from typing import Any

import torch


class Phase(enum.Enum):
    IDLE = "idle"  # no backward of the optimizer runs: an arriving gradient is an error
    NORM = "norm"  # gradients are measured (norm, inf/nan), nothing is written
    UPDATE = "update"  # each gradient updates its parameter
    ACCUMULATE = "accumulate"  # each gradient is added into its buffer (accumulation.py)


@dataclass(eq=False)
class StepMode:
    """What the hooks read (`phase`, `norm_ready`, `single_backward`: plain fields, so a
    compiled backward guards on values) and which loss a measured norm belongs to."""

    phase: Phase = Phase.IDLE
    # A norm pass measured this step's loss: the update pass skips on its overflow flag.
    norm_ready: bool = False
    # This update pass clips and checks the gradients as they arrive (no norm pass).
    single_backward: bool = False
    # The loss the norm pass measured (weakly: a collected loss whose id() is reused never
    # matches), with the clip threshold then and, under sharding, its graph.
    _norm_loss: weakref.ref[torch.Tensor] | None = None
    _norm_max_norm: float | None = None
    _norm_graph: Any = None

    def begin_pass(self, phase: Phase) -> None:
        self.phase = phase

    def end_pass(self) -> None:
        self.phase = Phase.IDLE

    # The transitions that keep a reference to the loss are host bookkeeping, kept out of a
    # compiled step (a traced weakref would break the graph and its guards recompile).
    @torch.compiler.disable
    def norm_measured(self, loss: torch.Tensor, max_norm: float | None, keep_graph: bool) -> None:
        """A norm pass of `loss` with clip threshold `max_norm` completed; `keep_graph`: the
        graph is remembered, to refuse back-propagating it a second time (ZeRO-3)."""
        self.norm_ready = True
        self._norm_loss = weakref.ref(loss)
        self._norm_max_norm = max_norm
        self._norm_graph = loss.grad_fn if keep_graph else None

    @torch.compiler.disable
    def keep_norm_only_for(
        self, loss: torch.Tensor, max_norm: float | None, same_batch: bool
    ) -> None:
        """Keeps the measured norm only if it is of `loss` with the threshold `max_norm`
        (`same_batch`: any loss counts, the norm pass having had a forward of its own)."""
        serves = self._norm_max_norm == max_norm and (
            same_batch or (self._norm_loss is not None and self._norm_loss() is loss)
        )
        self.norm_ready = self.norm_ready and serves

    def same_graph_as_norm(self, loss: torch.Tensor) -> bool:
        """Whether `loss` is the one whose graph the measured norm's pass back-propagated."""
        return self.norm_ready and loss.grad_fn is self._norm_graph

    @torch.compiler.disable
    def forget_norm(self) -> None:
        self.norm_ready = False
        self._norm_loss = None
        self._norm_graph = None

    def begin_update(self, single_backward: bool) -> None:
        self.single_backward = single_backward

    @torch.compiler.disable
    def end_update(self) -> bool:
        """Closes the update pass; returns whether a norm pass preceded it."""
        measured = self.norm_ready
        self.forget_norm()
        self.single_backward = False
        return measured
