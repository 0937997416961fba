"""What the optimizer tells about its steps: how many ran, the last norm pass's norms,
overflow (skipped or partial steps) and interrupted update passes.

A step's overflow flags stay on the device during backward; they are copied to the host
without blocking and reported at the next call (or the optimizer's `flush_report()`), when
the copy has long finished: as a RuntimeWarning (Python's warnings) for a skipped step
without a dynamic loss scaler and for a partial step, and in `last_step_skipped` /
`last_step_partial`; only an overflow at the fp16 loss scaler's minimum scale raises
(FloatingPointError). An exception raised during an update pass gets a note saying which
parameters were already updated.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from .loss_scaler import DynamicLossScaler

PARTIAL_STEP_WARNING = (
    "step {step}: {count} tensor(s) had inf/nan gradient elements and were left unchanged "
    "whole; the other tensors were updated (single_backward=True: an overflowing step is "
    "partial{scale}). The default single_backward=False checks every gradient first, which "
    "makes an overflowing step change nothing, at the cost of a second backward."
)

UPDATE_OVERFLOW_WARNING = (
    "step {step}: inf/nan gradient elements were found during the update; those elements "
    "were left unchanged, the rest of the step was applied. Set clip_grad_norm (or use fp16 "
    "loss scaling) to check before updating, which makes an overflowing step change nothing."
)

SKIPPED_STEP_WARNING = (
    "step {step}: inf/nan gradient elements made the global gradient norm non-finite; they "
    "were found before any update (by the norm pass, or in the accumulated micro-batches, "
    "whose buffers hold the loss-scaled sum: an fp16 buffer overflows past 65504), so the "
    "step was skipped whole: no parameter or moment changed (opt.last_step_skipped is True; "
    "the step counts in step_count, as lomo-optim's do). Lower the learning rate or check the "
    "data if this repeats (with an fp16 accumulation buffer: a lower loss scale, or "
    "accumulation_dtype=torch.float32)."
)

MIN_SCALE_ERROR = (
    "Current loss scale already at minimum - cannot decrease scale anymore. The gradients "
    "overflow even unscaled: lower the learning rate or check the data; pass "
    "loss_scale_args={'raise_error_at_min_scale': False} to go on."
)


def interruption_note(updated: list[str], total: int, tracked: bool) -> str:
    """The note added to an exception raised during an update pass."""
    if not tracked:
        return (
            "lomo_kernels: the update pass ran under compiled autograd, where the optimizer "
            "cannot tell which parameters were updated before this error: treat the model as "
            "partly stepped and reload a checkpoint (model and optimizer state_dict)"
        )
    if not updated:
        return (
            "lomo_kernels: raised during the update pass before any parameter was updated: "
            "the model and the optimizer state are unchanged"
        )
    shown = ", ".join(updated[:8]) + (f" and {len(updated) - 8} more" if len(updated) > 8 else "")
    return (
        f"lomo_kernels: raised during the update pass after {len(updated)} of {total} "
        f"parameters (and their optimizer state) were updated: {shown}. The model is now "
        "partly stepped (opt.last_step_partial_names lists them): reload a checkpoint (model "
        "and optimizer state_dict) to return to a consistent state"
    )


class StepReports:
    """What the optimizer tells about its steps: the step count, the last norm pass's norms,
    and each step's outcome, read from the device only at the next step.

    Public results (the optimizer's attributes of the same names): `step_count`,
    `last_grad_norm`, `clip_coef`, `grad_norms`, `last_step_skipped` (an overflow made the
    step change nothing), `last_step_partial` (inf/nan elements or tensors were left out,
    the rest applied), `last_step_interrupted` and `last_step_partial_names` (an exception
    in the update pass, and the parameters updated before it).
    """

    def __init__(
        self,
        names: Callable[[], dict[int, str]],
        parameter_count: int,
        scaler: DynamicLossScaler | None,
    ) -> None:
        """`names()`: the model's parameter names by id (read when an error is reported);
        `parameter_count`: how many parameters a step updates; `scaler`: the dynamic loss
        scaler whose minimum-scale overflow a report raises, if any."""
        self._names = names
        self._parameter_count = parameter_count
        self._scaler = scaler
        self.step_count = 0
        self.last_grad_norm: torch.Tensor | None = None
        self.clip_coef: torch.Tensor | None = None  # of the last norm pass (lomo-optim's)
        self._norm_of_last_pass: torch.Tensor | None = None
        self._param_norms: torch.Tensor | None = None  # of the last eager norm pass
        self._report: torch.Tensor | None = None
        self._report_event: Any = None
        self._report_single_backward = False  # the queued report is of a single_backward step
        self.last_step_skipped = False
        self.last_step_partial = False
        self.last_step_interrupted = False
        self.last_step_partial_names: list[str] = []

    @property
    def grad_norms(self) -> torch.Tensor | list[Any]:
        """lomo-optim's per-gradient norms of the last norm pass (`REPORTED_DOCS`)."""
        if self._norm_of_last_pass is None:
            return []
        return (
            self._norm_of_last_pass.reshape(1) if self._param_norms is None else self._param_norms
        )

    def norms_measured(
        self,
        norm: torch.Tensor,
        param_norms: torch.Tensor | None,
        clip_coef: torch.Tensor | None,
    ) -> None:
        """A norm pass measured the global `norm`, each parameter's (None under compiled
        autograd) and, with clipping on, the clip coefficient."""
        self._param_norms = param_norms
        self.last_grad_norm = self._norm_of_last_pass = norm
        if clip_coef is not None:
            self.clip_coef = clip_coef

    def begin_call(self) -> None:
        self.last_step_interrupted = False
        self.last_step_partial_names = []

    def record_interruption(
        self, error: BaseException, tracked: bool, updated: list[torch.Tensor]
    ) -> None:
        """Reports which parameters an interrupted update pass had already updated
        (`updated`, the step's record; a norm pass writes no parameter or state: its
        interruption changes nothing)."""
        names = self._names()
        self.last_step_interrupted = True
        self.last_step_partial_names = [names.get(id(p), "?") for p in updated]
        error.add_note(
            interruption_note(self.last_step_partial_names, self._parameter_count, tracked)
        )

    def step_done(self, found: torch.Tensor, atomic: bool, single_backward: bool) -> None:
        """Counts the step and copies its overflow flags to the host without waiting."""
        scaler = self._scaler
        at_min = scaler.overflow_at_min if scaler is not None else torch.zeros_like(found)
        flags = torch.cat(
            [
                found.reshape(1),
                at_min.to(found.device).reshape(1),
                torch.full_like(found.reshape(1), float(atomic)),
            ]
        )
        if flags.device.type == "cuda":
            if self._report is None:
                self._report = torch.empty(3, pin_memory=True)
            self._report.copy_(flags, non_blocking=True)
            self._report_event = torch.cuda.Event()
            # After the copy, which runs on the flags' device's stream (not necessarily the
            # current device's).
            self._report_event.record(torch.cuda.current_stream(flags.device))
        else:
            self._report = flags
            self._report_event = None
        self._report_single_backward = single_backward
        self.step_count += 1

    @torch.compiler.disable  # host-side: reads the flags copied at the last step
    def report_previous_step(self) -> None:
        """Reads the last step's overflow flags (long finished) and reports them."""
        if self._report is None:
            return
        if self._report_event is not None:
            self._report_event.synchronize()
        found, at_min, atomic = (float(x) for x in self._report.numpy())
        self._report = None
        self.last_step_skipped = bool(found) and bool(atomic)
        self.last_step_partial = bool(found) and not atomic
        scaler = self._scaler
        if at_min and scaler is not None and scaler.raise_error_at_min_scale:
            raise FloatingPointError(MIN_SCALE_ERROR)
        if found and not atomic and self._report_single_backward:
            scale = ", the loss scale was lowered" if scaler is not None else ""
            message = PARTIAL_STEP_WARNING.format(
                step=self.step_count - 1, count=int(found), scale=scale
            )
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        elif found and not atomic:
            message = UPDATE_OVERFLOW_WARNING.format(step=self.step_count - 1)
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        elif found and scaler is None:
            # A dynamic loss scaler's skipped step is its normal way of lowering the scale;
            # without one (bf16, fp32, AdaLomo's static scale) a skipped step is news.
            message = SKIPPED_STEP_WARNING.format(step=self.step_count - 1)
            warnings.warn(message, RuntimeWarning, stacklevel=3)


# The optimizer attributes that read the step reports (`Reported`), with their docs.
REPORTED_DOCS = {
    "step_count": "The number of completed steps (update passes).",
    "last_grad_norm": (
        "The global gradient norm of the last norm pass (or single_backward step), a 0-d or "
        "1-element device tensor; None before it, or once a step with no norm pass began."
    ),
    "clip_coef": (
        "lomo-optim's clip coefficient ``min(1, clip_grad_norm / (norm + 1e-6))`` of the last norm "
        "pass, a 0-d device tensor (``float()`` of it syncs); None before the first norm pass with "
        "clip_grad_norm set."
    ),
    "grad_norms": (
        "lomo-optim's per-gradient norms of the last norm pass (with accumulation_steps > 1, of "
        "the last step's accumulated gradients): a 1-D device tensor with one entry "
        "per trainable parameter (in model order; 0 for one that got no gradient, which lomo-optim "
        "leaves out), whose 2-norm is the global norm (``torch.norm(opt.grad_norms)``, as with "
        "lomo-optim). Sharded: each whole parameter's norm, on every rank. After a norm pass under "
        "compiled autograd it holds one entry, the global norm (that pass sums into one device "
        "scalar). ``[]`` before the first norm pass, as in lomo-optim."
    ),
    "last_step_skipped": (
        "Whether an overflow made the last step change nothing (reported at the next call)."
    ),
    "last_step_partial": (
        "Whether inf/nan elements or tensors were left out of the last step, the rest applied."
    ),
    "last_step_interrupted": "Whether an exception interrupted the last update pass.",
    "last_step_partial_names": (
        "The parameters the interrupted update pass had updated before the exception."
    ),
}


class Reported:
    """An optimizer attribute that reads its step reports' value of the same name (its
    `_reports`, a `StepReports`); assigning it is refused unless a `check` is given, which
    returns the value to keep or raises."""

    def __init__(self, check: Callable[[Any], Any] | None = None) -> None:
        self._check = check

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name
        self.__doc__ = REPORTED_DOCS[name]

    def __get__(self, optimizer: Any, owner: type | None = None) -> Any:
        if optimizer is None:
            return self
        return getattr(optimizer._reports, self._name)

    def __set__(self, optimizer: Any, value: Any) -> None:
        if self._check is None:
            raise AttributeError(f"{self._name} is what the optimizer reports: read-only")
        setattr(optimizer._reports, self._name, self._check(value))
