"""The step's scalars on each device in use: the 1-element fp32 tensors the kernels read
(lr, flags, sums of squares, the clip coefficient), so backward never waits for the host."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import ops
from ..core.scalars import copied_to


@dataclass
class DeviceScalars:
    """One device's scalars (one set per device in use)."""

    device: torch.device
    sumsq: torch.Tensor = field(init=False)
    norm_found_inf: torch.Tensor = field(init=False)
    update_found_inf: torch.Tensor = field(init=False)
    no_skip: torch.Tensor = field(init=False)
    clip_coef: torch.Tensor = field(init=False)
    inv_scale: torch.Tensor = field(init=False)  # the loss scaler's, copied once per step
    lr: dict[int, torch.Tensor] = field(default_factory=dict)  # by param group index
    # Per trainable parameter (by index), this device's part of the norm pass's sums of
    # squares; None where the pass runs under compiled autograd (one running sum there).
    param_sumsq: torch.Tensor | None = None
    # The parameters `measure` reached in this norm pass, in order of arrival.
    measured_slots: dict[int, None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        def zeros() -> torch.Tensor:
            return torch.zeros(1, device=self.device)

        self.sumsq, self.norm_found_inf, self.update_found_inf = zeros(), zeros(), zeros()
        self.no_skip, self.clip_coef = zeros(), torch.ones(1, device=self.device)
        self.inv_scale = torch.ones(1, device=self.device)

    def measure(
        self, grad: torch.Tensor, slot: int, inv_scale: torch.Tensor | None, backend: str | None
    ) -> None:
        """The norm pass's one accumulator: adds the sum of squares of `grad` (a whole
        gradient, a block of its rows or this rank's slice of it; times `inv_scale`) of
        parameter `slot` into that parameter's sum, or into the running total under compiled
        autograd, and its non-finite flag into the pass's."""
        ops.grad_sumsq_(
            grad,
            self.slot_sum(slot),
            inv_scale=inv_scale,
            found_inf=self.norm_found_inf,
            backend=backend,
        )

    def slot_sum(self, slot: int, anew: bool = False) -> torch.Tensor:
        """Where a norm pass (or a measuring micro-batch) adds parameter `slot`'s sum of
        squares: its entry of `param_sumsq`, noted as reached, or the running total under
        compiled autograd. `anew`: the entry's earlier sum is dropped (it measured part of
        what the caller measures now: per-parameter sums only)."""
        if self.param_sumsq is None:
            if anew:
                raise AssertionError("a running total cannot drop one parameter's sum")
            return self.sumsq
        self.measured_slots[slot] = None
        entry = self.param_sumsq[slot : slot + 1]
        return entry.zero_() if anew else entry

    def close_norm_pass(self) -> None:
        """The total from the parameters' sums, added in the order they arrived: the rounding
        of summing each gradient into the total as it came (each sum starts at 0)."""
        if self.param_sumsq is None:
            return
        for slot in self.measured_slots:
            self.sumsq.add_(self.param_sumsq[slot : slot + 1])
        self.measured_slots.clear()

    def skip_flag(self, norm_ready: bool) -> torch.Tensor:
        """What an update skips on: the norm pass's overflow flag where one measured this
        step (`norm_ready`), else a flag that never skips."""
        return self.norm_found_inf if norm_ready else self.no_skip


class DeviceScalarTable(dict[torch.device, DeviceScalars]):
    """The scalars of every device in use, by device (created on first use): a dict, which a
    compiled step traces as it traces a dict."""

    def for_device(self, device: torch.device) -> DeviceScalars:
        if device not in self:
            self[device] = DeviceScalars(device)
        return self[device]

    def begin_step(self, param_groups: Sequence[Mapping[str, Any]], fill_lr: bool = True) -> None:
        """Sets each group's lr on the devices its parameters live on (`fill_lr`: else only
        made, for the caller to fill), clears the update's overflow flags (host-side, no
        sync)."""
        for index, group in enumerate(param_groups):
            for p in group["params"]:
                scalars = self.for_device(p.device)
                if index not in scalars.lr:
                    scalars.lr[index] = torch.zeros(1, device=p.device)
        if fill_lr:  # else filled by the call's lr once nothing can refuse it
            self.fill_lr(param_groups)
        for scalars in self.values():
            scalars.update_found_inf.zero_()

    def fill_lr(self, param_groups: Sequence[Mapping[str, Any]]) -> None:
        """Each group's lr into its device tensors (host-side, no sync)."""
        for index, group in enumerate(param_groups):
            for scalars in self.values():
                if index in scalars.lr:
                    scalars.lr[index].fill_(group["lr"])

    def groups_present(
        self, groups: Sequence[dict[str, Any]]
    ) -> Iterator[tuple[torch.device, DeviceScalars, int, dict[str, Any]]]:
        """(device, its scalars, group index, group) of each of `groups` that has a
        parameter on that device (the step set its lr there)."""
        for device, scalars in self.items():
            for index, group in enumerate(groups):
                if index in scalars.lr:
                    yield device, scalars, index, group

    def begin_norm_pass(self, slots: int | None) -> None:
        """Clears the norm pass's sums and flags; `slots`: the number of trainable parameters
        to keep a sum each for, None for the one running sum."""
        for scalars in self.values():
            scalars.sumsq.zero_()
            scalars.norm_found_inf.zero_()
            scalars.param_sumsq = (
                None if slots is None else torch.zeros(slots, device=scalars.device)
            )
            scalars.measured_slots.clear()

    def close_norm_pass(self) -> None:
        """Each device's total of the norm pass (`DeviceScalars.close_norm_pass`)."""
        for scalars in self.values():
            scalars.close_norm_pass()

    def combine(self, pick: Callable[[DeviceScalars], torch.Tensor]) -> torch.Tensor:
        """Sum of one per-device tensor over devices, on the first device."""
        values = [pick(s) for s in self.values()]
        total = values[0].clone()
        for v in values[1:]:
            total += copied_to(v, total.device)
        return total

    def share_norm_outcome(self, found: torch.Tensor, clip_coef: torch.Tensor | None) -> None:
        """Gives every device the norm pass's overflow flag and, with clipping on, its clip
        coefficient."""
        for device, scalars in self.items():
            scalars.norm_found_inf.copy_(copied_to(found, device))
            if clip_coef is not None:
                scalars.clip_coef.copy_(copied_to(clip_coef, device))
