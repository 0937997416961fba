"""Dynamic loss scaling that lives on the device: no host sync to scale, check or adjust.

Same knobs and rules as lomo-optim's DynamicLossScaler (which itself follows DeepSpeed's),
with its defect fixed: after `scale_window` clean steps the scale grows again.
"""

from __future__ import annotations

import math
from typing import Any

import torch

LOSS_SCALE_KEYS = (
    "init_scale",
    "scale_factor",
    "scale_window",
    "min_scale",
    "delayed_shift",
    "consecutive_hysteresis",
    "raise_error_at_min_scale",
)


# What a checkpoint holds: the running values, then every setting but the initial scale.
STATE_KEYS = ("scale", "hysteresis", "cur_iter", "last_overflow_iter", *LOSS_SCALE_KEYS[1:])


def _check_settings(
    where: str,
    scale: float,
    scale_factor: float,
    scale_window: int,
    delayed_shift: int,
    min_scale: float,
    scale_name: str = "scale",
) -> None:
    """The scaler's numbers, as the constructor takes them and as a state_dict holds them."""
    for name, value in ((scale_name, scale), ("min_scale", min_scale)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{where}: {name} must be finite and > 0, got {value}")
    if not (math.isfinite(scale_factor) and scale_factor > 1):
        raise ValueError(f"{where}: scale_factor must be > 1, got {scale_factor}")
    if int(scale_window) < 1 or int(delayed_shift) < 1:
        raise ValueError(f"{where}: scale_window and delayed_shift must be >= 1")


def check_scaler_state(state: Any, where: str = "state_dict loss_scaler") -> None:
    """Refuses a saved scaler state that is incomplete or would scale wrongly."""
    if not isinstance(state, dict) or set(STATE_KEYS) - set(state):
        raise ValueError(f"{where} must be a dict with the keys {', '.join(STATE_KEYS)}")
    try:
        floats = [float(state[k]) for k in ("scale", "scale_factor", "min_scale")]
        ints = [int(state[k]) for k in ("scale_window", "delayed_shift")]
        counters = [int(state[k]) for k in ("hysteresis", "cur_iter", "last_overflow_iter")]
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where}: a value is not a number ({error})") from None
    _check_settings(where, floats[0], floats[1], ints[0], ints[1], floats[2])
    if counters[0] < 0 or counters[1] < 0 or counters[2] < -1:
        raise ValueError(f"{where}: negative hysteresis or iteration counter {counters}")


class DynamicLossScaler:
    """Loss scale, hysteresis and iteration counters held in device tensors.

    `update(found_inf)` applies one step's outcome with tensor ops only. Whether the step hit
    the minimum scale (an error with `raise_error_at_min_scale`) is kept in a device flag the
    optimizer reads without stalling the device.
    """

    def __init__(
        self,
        device: torch.device,
        init_scale: float = 2.0**16,
        scale_factor: float = 2.0,
        scale_window: int = 1000,
        min_scale: float = 1.0,
        delayed_shift: int = 1,
        consecutive_hysteresis: bool = False,
        raise_error_at_min_scale: bool = True,
    ) -> None:
        _check_settings(
            "loss_scale_args",
            init_scale,
            scale_factor,
            scale_window,
            delayed_shift,
            min_scale,
            scale_name="init_scale",
        )
        self.device = device
        self.scale_factor = float(scale_factor)
        self.scale_window = int(scale_window)
        self.min_scale = float(min_scale)
        self.delayed_shift = int(delayed_shift)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.raise_error_at_min_scale = bool(raise_error_at_min_scale)
        self.scale = torch.full((1,), float(init_scale), device=device)
        self.inv_scale = torch.reciprocal(self.scale)
        self.hysteresis = torch.full((1,), self.delayed_shift, device=device, dtype=torch.int64)
        self.cur_iter = torch.zeros(1, device=device, dtype=torch.int64)
        self.last_overflow_iter = torch.full((1,), -1, device=device, dtype=torch.int64)
        # Raised when an overflow happens while the scale is already at its minimum.
        self.overflow_at_min = torch.zeros(1, device=device)
        self.overflow = torch.zeros(1, device=device)  # the last outcome applied
        # How often the caller set the scale (cur_scale, load_state_dict): a host count, as
        # reading the scale would sync with the device.
        self.times_set = 0

    def update(self, found_inf: torch.Tensor, apply: torch.Tensor | None = None) -> None:
        """One step's bookkeeping, given the step's overflow flag (1-element, on device).

        `apply` (a bool device tensor): change the state only where it is True. A norm pass
        applies an overflow at once (lomo-optim lowers the scale there, and its trainer then
        skips the update pass); the update pass applies the clean outcome.
        """
        overflow = found_inf.reshape(1) != 0
        self.overflow.copy_(overflow.float())  # what has_overflow_serial reports
        shift_now = (self.hysteresis == 1) | (self.delayed_shift == 1)
        at_min = self.scale <= self.min_scale
        lowered = torch.clamp(self.scale / self.scale_factor, min=self.min_scale)
        since = self.cur_iter - self.last_overflow_iter
        grow = ~overflow & (torch.remainder(since, self.scale_window) == 0)
        new_scale = torch.where(overflow & shift_now, lowered, self.scale)
        new_scale = torch.where(grow, self.scale * self.scale_factor, new_scale)
        restore = ~overflow & (grow | self.consecutive_hysteresis)
        new_hyst = torch.where(overflow & ~shift_now, self.hysteresis - 1, self.hysteresis)
        new_hyst = torch.where(restore, torch.full_like(new_hyst, self.delayed_shift), new_hyst)
        last_overflow = torch.where(overflow, self.cur_iter, self.last_overflow_iter)
        updates = (
            (self.overflow_at_min, (overflow & shift_now & at_min).float()),
            (self.last_overflow_iter, last_overflow),
            (self.scale, new_scale),
            (self.hysteresis, new_hyst),
            (self.cur_iter, self.cur_iter + 1),
        )
        for current, new in updates:
            current.copy_(new if apply is None else torch.where(apply, new, current))
        torch.reciprocal(self.scale, out=self.inv_scale)

    # lomo-optim's names. Each reads a device tensor: a host sync where it lives on a GPU.
    @property
    def has_overflow_serial(self) -> bool:
        """Whether the last norm pass (or, after the update pass, the last step) found an
        inf/nan gradient. Reading it syncs with the device."""
        return bool(self.overflow.item())

    @has_overflow_serial.setter
    def has_overflow_serial(self, value: bool) -> None:
        self.overflow.fill_(float(bool(value)))

    @property
    def loss_scale(self) -> float:
        """The current loss scale (reading it syncs with the device)."""
        return self.scale.item()

    @property
    def cur_scale(self) -> float:
        """lomo-optim's name for `loss_scale`; assigning it sets the scale (checked)."""
        return self.scale.item()

    @cur_scale.setter
    def cur_scale(self, value: float) -> None:
        settings = (self.scale_factor, self.scale_window, self.delayed_shift, self.min_scale)
        _check_settings("cur_scale", value, *settings)
        self.scale.fill_(float(value))
        torch.reciprocal(self.scale, out=self.inv_scale)
        self.times_set += 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale.item(),
            "hysteresis": int(self.hysteresis.item()),
            "cur_iter": int(self.cur_iter.item()),
            "last_overflow_iter": int(self.last_overflow_iter.item()),
            "scale_factor": self.scale_factor,
            "scale_window": self.scale_window,
            "min_scale": self.min_scale,
            "delayed_shift": self.delayed_shift,
            "consecutive_hysteresis": self.consecutive_hysteresis,
            "raise_error_at_min_scale": self.raise_error_at_min_scale,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale_factor = float(state["scale_factor"])
        self.scale_window = int(state["scale_window"])
        self.min_scale = float(state["min_scale"])
        self.delayed_shift = int(state["delayed_shift"])
        self.consecutive_hysteresis = bool(state["consecutive_hysteresis"])
        self.raise_error_at_min_scale = bool(state["raise_error_at_min_scale"])
        self.scale.fill_(float(state["scale"]))
        self.hysteresis.fill_(int(state["hysteresis"]))
        self.cur_iter.fill_(int(state["cur_iter"]))
        self.last_overflow_iter.fill_(int(state["last_overflow_iter"]))
        self.overflow_at_min.zero_()
        self.overflow.zero_()
        torch.reciprocal(self.scale, out=self.inv_scale)
        self.times_set += 1
