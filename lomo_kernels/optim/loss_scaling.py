"""How an optimizer scales its loss and unscales the gradients: not at all (bf16, fp32
Lomo), by a fixed factor (AdaLomo's ``loss_scale``, as lomo-optim's) or by an fp16 dynamic
scale (`loss_scaler.DynamicLossScaler`) that a step's overflow lowers.

Each form tells the step the same things: the loss to back-propagate, the gradients'
inverse scale on each device (a device tensor, or None for 1), whether overflows are
looked for before any update (fp16), and what a step's overflow changes.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.scalars import copied_to, optional_factor
from ._hyper import checked_group
from .device_scalars import DeviceScalarTable
from .loss_scaler import DynamicLossScaler


class LossScaling:
    """No scaling: the gradients arrive as they are. `fp16`: the trained parameters compute
    in fp16, so each step looks for overflows before any update."""

    # The dynamic scaler, whose state the checkpoint and the step reports read (None here).
    scaler: DynamicLossScaler | None = None
    # Where the caller sets the scale (named by the accumulation's refusal of a new one).
    setting_name = "the loss scale"

    def __init__(self, fp16: bool = False) -> None:
        self.fp16 = fp16

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to back-propagate (called under grad)."""
        return loss

    def inv_scale_for(
        self, device: torch.device, scalars: DeviceScalarTable
    ) -> torch.Tensor | None:
        """The gradients' inverse scale on `device` as the ops take it: a device tensor, or
        None for 1."""
        return None

    def setting(self) -> object:
        """The scale as the caller set it, for `scale_changed_since` (no host sync)."""
        return None

    def scale_changed_since(self, setting: object) -> bool:
        """Whether the caller set another scale since `setting()` returned `setting` (the
        steps' own changes aside)."""
        return setting != self.setting()

    def begin_step(self, scalars: DeviceScalarTable) -> None:
        """Host-side preparation of a step on the devices of `scalars`."""

    def check(self, owner: str) -> None:
        """Refuses, before any change, a scale set to a value the step cannot use; `owner`
        names the optimizer in the error."""

    def begin_attempt(self) -> None:
        """A user's norm pass starts a step attempt, and a failed update pass ends one: the
        next norm pass's overflow counts anew."""

    def after_norm_pass(self, found_inf: torch.Tensor) -> None:
        """A norm pass found `found_inf` (non-zero: an overflow)."""

    def after_step(self, found_inf: torch.Tensor, detection: bool) -> None:
        """A step completed with `found_inf`; `detection`: a norm pass preceded it."""

    def state_dict(self) -> dict[str, Any] | None:
        return None if self.scaler is None else self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restores a saved scaler's state (checked); nothing without a scaler here."""
        if state is not None and self.scaler is not None:
            self.scaler.load_state_dict(state)


class StaticLossScale(LossScaling):
    """A fixed factor (`loss_scale`, which may be reassigned between steps; checked at each)."""

    setting_name = "loss_scale"

    def __init__(self, loss_scale: float, fp16: bool) -> None:
        super().__init__(fp16)
        self.loss_scale = loss_scale

    def setting(self) -> object:
        return self.loss_scale

    def _inv_scale(self) -> float:
        return 1.0 / self.loss_scale

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        inv_scale = self._inv_scale()
        return loss if inv_scale == 1.0 else loss / inv_scale

    def inv_scale_for(
        self, device: torch.device, scalars: DeviceScalarTable
    ) -> torch.Tensor | None:
        return optional_factor("inv_scale", self._inv_scale(), device)

    def check(self, owner: str) -> None:
        checked_group({"loss_scale": self.loss_scale}, owner)


class DynamicScaling(LossScaling):
    """fp16's dynamic scale: an overflow lowers it, clean steps grow it back (all on the
    scaler's device, the first trained parameter's)."""

    setting_name = "loss_scaler.cur_scale"

    def __init__(self, scaler: DynamicLossScaler) -> None:
        super().__init__(fp16=True)
        self.scaler = scaler
        # Whether a norm pass of the current step attempt applied an overflow.
        self._overflow_applied = torch.zeros(1, dtype=torch.bool, device=scaler.device)

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * copied_to(self.scaler.scale, loss.device).reshape(())

    def inv_scale_for(
        self, device: torch.device, scalars: DeviceScalarTable
    ) -> torch.Tensor | None:
        if self.scaler.device == device:
            return self.scaler.inv_scale
        return scalars[device].inv_scale

    def setting(self) -> object:
        return self.scaler.times_set, self.scaler.scale.clone()

    def scale_changed_since(self, setting: object) -> bool:
        times_set, scale = setting
        # The device is read only where the caller set the scale since (then it syncs).
        return times_set != self.scaler.times_set and not torch.equal(scale, self.scaler.scale)

    def begin_step(self, scalars: DeviceScalarTable) -> None:
        for device_scalars in scalars.values():
            if device_scalars.device != self.scaler.device:
                # One copy per device and step, not one per parameter in the hooks.
                device_scalars.inv_scale.copy_(self.scaler.inv_scale, non_blocking=True)

    def begin_attempt(self) -> None:
        self._overflow_applied.zero_()

    def after_norm_pass(self, found_inf: torch.Tensor) -> None:
        # As lomo-optim: an overflow found by the norm pass lowers the scale now, so a loop
        # that skips the update pass on has_overflow_serial (its trainer's) still backs off;
        # once per attempt (fused_backward re-measures another loss than grad_norm's).
        found = found_inf.to(self.scaler.device).reshape(1) != 0
        self.scaler.update(found, apply=found & ~self._overflow_applied)
        self._overflow_applied |= found

    def after_step(self, found_inf: torch.Tensor, detection: bool) -> None:
        found = found_inf.to(self.scaler.device).reshape(1) != 0
        # An overflow a norm pass applied is this step's outcome (see after_norm_pass).
        apply = ~self._overflow_applied & (~found if detection else True)
        self.scaler.update(found, apply=apply)
        self._overflow_applied.zero_()
