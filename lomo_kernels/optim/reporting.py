"""What the optimizer tells about a step after it: overflow (skipped or partial steps) and
interrupted update passes.

A step's overflow flags stay on the device during backward; they are copied to the host
without blocking and reported at the next call (or `flush_report()`), when the copy has long
finished: as a RuntimeWarning (Python's warnings) for a skipped step without a dynamic loss
scaler and for a partial step, and in `last_step_skipped` / `last_step_partial`; only an
overflow at the fp16 loss scaler's minimum scale raises (FloatingPointError). An exception
raised during an update pass gets a note saying which parameters were already updated.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from .validation import parameter_names

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
    "step {step}: inf/nan gradient elements made the global gradient norm non-finite; the "
    "norm pass found them before any update, so the step was skipped whole: no parameter or "
    "optimizer state changed (opt.last_step_skipped is True). Lower the learning rate or "
    "check the data if this repeats."
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


class StepReporting:
    """The optimizer's step reports (mixed into `InBackwardOptimizer`, which provides
    `model`, `param_groups`, `step_count` and `_loss_scaler()`).

    Public results: `last_step_skipped` (an overflow made the step change nothing),
    `last_step_partial` (inf/nan elements or tensors were left out, the rest applied),
    `last_step_interrupted` and `last_step_partial_names` (an exception in the update pass,
    and the parameters updated before it).
    """

    model: Any
    param_groups: list[dict[str, Any]]
    step_count: int

    def _init_reporting(self) -> None:
        self._report: torch.Tensor | None = None
        self._report_event: Any = None
        self._report_single_backward = False  # the queued report is of a single_backward step
        self.last_step_skipped = False
        self.last_step_partial = False
        self.last_step_interrupted = False
        self.last_step_partial_names: list[str] = []
        self._updated: list[torch.Tensor] = []  # the update pass's parameters, in order

    def _begin_pass_report(self) -> None:
        self.last_step_interrupted = False
        self.last_step_partial_names = []

    def _note_updated(self, param: torch.Tensor) -> None:
        # Noted before the update is launched: a failing update counts as applied. Traced
        # (compiled autograd), the append would replay only after the graph; not recorded.
        if not torch.compiler.is_compiling():
            self._updated.append(param)

    def _record_interruption(self, error: BaseException, tracked: bool) -> None:
        """Reports which parameters an interrupted update pass had already updated (a norm
        pass writes no parameter or state: its interruption changes nothing)."""
        names = parameter_names(self.model)
        self.last_step_interrupted = True
        self.last_step_partial_names = [names.get(id(p), "?") for p in self._updated]
        total = sum(len(g["params"]) for g in self.param_groups)
        error.add_note(interruption_note(self.last_step_partial_names, total, tracked))

    def _queue_report(self, found: torch.Tensor, atomic: bool, single_backward: bool) -> None:
        """Copies the step's overflow flags to the host without waiting for them."""
        scaler = self._loss_scaler()
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

    @torch.compiler.disable  # host-side: reads the flags copied at the last step
    def _report_previous_step(self) -> None:
        """Reads the last step's overflow flags (long finished) and reports them."""
        if self._report is None:
            return
        if self._report_event is not None:
            self._report_event.synchronize()
        found, at_min, atomic = (float(x) for x in self._report.numpy())
        self._report = None
        self.last_step_skipped = bool(found) and bool(atomic)
        self.last_step_partial = bool(found) and not atomic
        scaler = self._loss_scaler()
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

    def flush_report(self) -> None:
        """Reports the last step's overflow now (at the end of training, for example)."""
        self._report_previous_step()
