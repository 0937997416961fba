"""Hyper-parameter checks, written once and used by the constructors, every step (on the
current ``param_groups``) and ``load_state_dict``.

Each check returns the value as the kernels take it (``clip_grad_value <= 0`` becomes None:
off, as in lomo-optim) or raises with what is wrong and what to pass instead.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch


def _finite(name: str, value: Any) -> float:
    if isinstance(value, torch.Tensor):
        raise TypeError(
            f"{name} must be a Python number, not a tensor (the optimizer keeps it in a "
            "device tensor of its own)"
        )
    # numbers.Real: numpy's scalars too (np.float32 is no float subclass); bool is no number here.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


def check_lr(lr: Any) -> float:
    value = _finite("lr", lr)
    if value < 0:
        raise ValueError(f"lr must be a finite number >= 0, got {value}")
    return value


def check_step_count(step_count: Any, name: str = "step_count") -> int:
    """The completed steps' count: AdaLomo's beta2 and the rounding seed are drawn from it."""
    if isinstance(step_count, bool) or not isinstance(step_count, numbers.Integral):
        raise TypeError(f"{name} must be an int >= 0, got {step_count!r}")
    if step_count < 0:
        raise ValueError(f"{name} must be an int >= 0, got {step_count!r}")
    return int(step_count)


def check_weight_decay(weight_decay: Any) -> float:
    value = _finite("weight_decay", weight_decay)
    if value < 0:
        raise ValueError(
            f"weight_decay must be >= 0, got {value}: lomo-optim ignores a negative value, "
            "which here would grow the weights every step; pass 0 to switch decay off"
        )
    return value


def check_clip_grad_norm(clip_grad_norm: Any) -> float | None:
    if clip_grad_norm is None:
        return None
    value = _finite("clip_grad_norm", clip_grad_norm)
    if value <= 0:
        raise ValueError(f"clip_grad_norm should be positive, got {value} (None: no clipping)")
    return value


def check_clip_grad_value(clip_grad_value: Any) -> float | None:
    """lomo-optim clips by value only when clip_grad_value > 0: 0 or less means off."""
    if clip_grad_value is None:
        return None
    value = _finite("clip_grad_value", clip_grad_value)
    return value if value > 0 else None


# eps[0] is added to the squared gradient: at least float32's smallest normal number keeps a
# zero row or column's second moment positive (a subnormal flushes to 0 where denormals do).
EPS0_FLOOR = torch.finfo(torch.float32).tiny


def check_eps(eps: Any) -> tuple[float, float]:
    if not isinstance(eps, (tuple, list)) or len(eps) != 2:
        raise ValueError(f"eps must be two finite numbers >= 0, got {eps!r}")
    values = tuple(_finite("eps", e) for e in eps)
    if min(values) < 0:
        raise ValueError(f"eps must be two finite numbers >= 0, got {eps!r}")
    if values[0] < EPS0_FLOOR:
        raise ValueError(
            f"eps[0] must be >= {EPS0_FLOOR:.3g} (float32's smallest normal number), got "
            f"{values[0]!r}: where a gradient's row or column is all zeros (an embedding row "
            "no token used) its second moment is eps[0], and 0 makes that update 0/0 = nan; "
            "lomo-optim's default is 1e-30"
        )
    return values


def _positive(name: str) -> Callable[[Any], float]:
    def check(value: Any) -> float:
        value = _finite(name, value)
        if value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")
        return value

    return check


def check_decay_rate(decay_rate: Any) -> float:
    value = _finite("decay_rate", decay_rate)
    if value >= 0:
        raise ValueError(f"decay_rate must be < 0 (beta2_t = 1 - t**decay_rate), got {value}")
    return value


check_clip_threshold = _positive("clip_threshold")
check_loss_scale = _positive("loss_scale")

CHECKS: dict[str, Callable[[Any], Any]] = {
    "lr": check_lr,
    "weight_decay": check_weight_decay,
    "clip_grad_norm": check_clip_grad_norm,
    "clip_grad_value": check_clip_grad_value,
    "eps": check_eps,
    "clip_threshold": check_clip_threshold,
    "decay_rate": check_decay_rate,
    "loss_scale": check_loss_scale,
}


def checked_group(group: Mapping[str, Any], where: str | None = None) -> dict[str, Any]:
    """A param group's hyper-parameters (all keys but "params"), checked and normalised.

    Keys without a check (a scheduler's "initial_lr", for example) pass unchanged. `where`
    names the group in the error ("param_groups[0]").
    """
    checked = {}
    for key, value in group.items():
        if key == "params":
            continue
        check = CHECKS.get(key)
        try:
            checked[key] = value if check is None else check(value)
        except (TypeError, ValueError) as error:
            raise type(error)(error if where is None else f"{where}: {error}") from None
    return checked


def checked_groups(
    groups: Sequence[Mapping[str, Any]],
    where: str,
    lr: float | None = None,
    required: Iterable[str] = (),
) -> list[dict[str, Any]]:
    """`checked_group` of every group (with `lr` in place of the groups' own when given),
    each holding every key of `required`; `where` names the list in errors ("param_groups")."""
    override = {} if lr is None else {"lr": lr}
    required = tuple(required)
    for i, group in enumerate(groups):
        missing = sorted(set(required) - set(group) - set(override))
        if missing:
            raise ValueError(
                f"{where}[{i}] has no {missing}: every group keeps each of the optimizer's "
                f"hyper-parameters ({', '.join(required)}); set the value back"
            )
    checked = [
        checked_group({**group, **override}, f"{where}[{i}]") for i, group in enumerate(groups)
    ]
    norms = {group.get("clip_grad_norm") for group in checked}
    if len(norms) > 1:
        raise ValueError(
            f"{where}: the groups have different clip_grad_norm values "
            f"{sorted(map(str, norms))}: clipping by the global norm has one threshold; set the "
            "same value in every group (opt.clip_grad_norm = value does)"
        )
    return checked
