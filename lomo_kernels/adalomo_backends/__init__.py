"""Backends of the fused AdaLomo passes, and the workspace layout they share.

Every backend module implements the same six functions (see `reference.py`, the executable
specification): `factored_stats_`, `factored_moments_`, `factored_norm_`, `factored_apply_`
for tensors with >= 2 dims (viewed as [rows, cols], cols = shape[-1]) and `vector_stats_`,
`vector_apply_` for 1-D tensors. Each is one kernel launch in the compiled backends.

Selection follows `lomo_kernels.backends`: explicit argument, then $LOMO_KERNELS_BACKEND, then
the best available; an unavailable backend is reported once with a warning and the next one
in line is used. The pure-PyTorch backend is always there.

Workspace: one fp32 tensor per parameter per step, zeroed by its single allocation:
``[row sums (rows) | column sums (cols) | P_SUMSQ, U_SUMSQ, SKIP, R_SUM]`` for factored
tensors, only the four slots for 1-D tensors.
"""

from __future__ import annotations

import os
import warnings
from types import ModuleType

import torch

from ..backends import ENV_VAR, requested_backend
from . import reference

# Slots after the row/column sums (the C++/CUDA sources repeat these numbers).
P_SUMSQ = 0  # sum of param^2 (fp32 of the stored values)
U_SUMSQ = 1  # sum of update^2 before the rms clip
SKIP = 2  # non-zero: this parameter is not updated (skip_if set, or a non-finite gradient)
R_SUM = 3  # sum of the updated row moments (factored tensors)
NUM_SLOTS = 4

_warned: set[tuple[str, str]] = set()
_cache: dict[tuple[str, str], ModuleType] = {}


def workspace_numel(shape: torch.Size) -> int:
    """Length of the fp32 workspace of a parameter of `shape`."""
    if len(shape) >= 2:
        cols = shape[-1]
        rows = shape.numel() // cols if cols else 0
        return rows + cols + NUM_SLOTS
    return NUM_SLOTS


def _load(name: str, device_type: str) -> tuple[ModuleType | None, str]:
    """The backend module if it serves `device_type`, else None and the reason."""
    if name == "torch":
        return reference, ""
    try:
        if name == "triton":
            from . import triton as module
        else:
            from . import cpp as module
    except Exception as exc:  # a broken optional dependency must not break the package
        return None, f"import failed: {exc!r}"
    if name == "triton":
        if device_type not in ("cuda", "cpu"):
            return None, f"no Triton kernels for {device_type} tensors"
        reason = module.unavailable_reason()
        if reason:
            return None, reason
        if device_type == "cpu" and not module.interpret_mode():
            return None, "Triton runs on CPU tensors only under TRITON_INTERPRET=1"
        return module, ""
    if not module.is_available(device_type):
        return None, module.unavailable_reason(device_type)
    return module, ""


def _auto_order(device_type: str) -> tuple[str, ...]:
    if device_type == "cuda":
        return ("triton", "cpp", "torch")
    if device_type == "cpu":
        return ("cpp", "torch")
    return ("torch",)


def resolve(device: torch.device, backend: str | None = None) -> ModuleType:
    """The backend module that runs the AdaLomo passes on tensors of `device`."""
    name = requested_backend(backend)
    # TRITON_INTERPRET decides whether Triton serves CPU tensors: part of the cache key.
    key = (name, device.type, os.environ.get("TRITON_INTERPRET", ""))
    cached = _cache.get(key)
    if cached is not None:
        return cached
    order = _auto_order(device.type)
    if name != "auto":
        order = (name,) + tuple(n for n in order if n != name)
    chosen = reference
    for candidate in order:
        module, reason = _load(candidate, device.type)
        if module is not None:
            chosen = module
            break
        warn_key = (candidate, device.type)
        if (name == candidate or candidate == order[0]) and warn_key not in _warned:
            _warned.add(warn_key)
            warnings.warn(
                f"lomo_kernels: AdaLomo backend {candidate!r} unavailable for {device.type} "
                f"tensors ({reason}); falling back (set ${ENV_VAR} to choose)",
                RuntimeWarning,
                stacklevel=3,
            )
    _cache[key] = chosen
    return chosen


def backend_name(module: ModuleType) -> str:
    """Short name ('torch', 'cpp', 'triton') of a backend module."""
    return {"reference": "torch", "cpp": "cpp", "triton": "triton"}[
        module.__name__.rsplit(".", 1)[-1]
    ]
