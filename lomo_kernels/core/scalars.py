"""Runtime scalars of the fused ops: always 1-element fp32 tensors on the parameter's device.

lr, beta2, inv_scale and clip_coef change from step to step (a schedule, a loss scale, a
norm computed on the device). Every op and every kernel takes them one way only, as device
tensors read by the kernel, so nothing forces a host sync and a compiled graph does not
specialise on their values. Python floats are converted once, here, at the public
functions; a float that means "no-op" (inv_scale 1, no clip coefficient) becomes None so the
kernels skip the multiply. Hyper-parameters fixed for a run (weight_decay, clip_value, eps,
clip_threshold) stay plain floats: kernel arguments, never specialised on.
"""

from __future__ import annotations

import torch

from .checks import check_finite, check_scalar_tensor

Scalar = float | torch.Tensor

# Converted floats, reused across calls: one fill kernel per distinct value and device rather
# than one per call. The kernels never write these. Bounded: an lr schedule makes new values.
_CACHE: dict[tuple[float, torch.device], torch.Tensor] = {}
_CACHE_LIMIT = 256


def _constant(value: float, device: torch.device) -> torch.Tensor:
    if torch.compiler.is_compiling():
        # In a traced region the constant becomes part of the graph; no cache to consult.
        return torch.full((1,), value, dtype=torch.float32, device=device)
    key = (value, device)
    cached = _CACHE.get(key)
    if cached is None:
        if len(_CACHE) >= _CACHE_LIMIT:
            _CACHE.clear()
        cached = torch.full((1,), value, dtype=torch.float32, device=device)
        _CACHE[key] = cached
    return cached


def device_scalar(
    name: str,
    value: Scalar,
    device: torch.device,
    *,
    non_negative: bool = False,
    unit_interval: bool = False,
) -> torch.Tensor:
    """`value` as a 1-element fp32 tensor on `device` (a tensor is checked and passed through).

    Range checks apply to Python floats only: a device value cannot be read without a sync.
    """
    if isinstance(value, torch.Tensor):
        check_scalar_tensor(name, value, device)
        return value
    check_finite(name, value, non_negative=non_negative)
    if unit_interval and not 0.0 <= value <= 1.0:
        raise ValueError(f"lomo_kernels: {name} must be in [0, 1], got {value}")
    return _constant(float(value), device)


def optional_factor(name: str, value: Scalar | None, device: torch.device) -> torch.Tensor | None:
    """A multiplicative factor as a device tensor, or None where it is absent or exactly 1."""
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        check_finite(name, value)
        if value == 1.0:
            return None
    return device_scalar(name, value, device)


def copied_to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device` without a host sync where none is needed: onto a GPU asynchronously;
    onto the CPU synchronously, as an asynchronous device-to-host copy lands in pinned memory
    that the host would read before the copy has ended (a model partly on the CPU)."""
    return t.to(device, non_blocking=device.type != "cpu")


def value_of(scalar: torch.Tensor) -> torch.Tensor:
    """The fp32 value of a 1-element device tensor, as a 0-d tensor (no host sync)."""
    return scalar.reshape(-1)[0].to(torch.float32)
