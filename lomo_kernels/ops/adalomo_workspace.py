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

from types import ModuleType

import torch

from ..backends._selection import BackendRegistry
from . import reference

# Slots after the row/column sums (the C++/CUDA sources repeat these numbers).
P_SUMSQ = 0  # sum of param^2 (fp32 of the stored values)
U_SUMSQ = 1  # sum of update^2 before the rms clip
SKIP = 2  # non-zero: this parameter is not updated (skip_if set, or a non-finite gradient)
R_SUM = 3  # sum of the updated row moments (factored tensors)
NUM_SLOTS = 4


def workspace_numel(shape: torch.Size) -> int:
    """Length of the fp32 workspace of a parameter of `shape`."""
    if len(shape) >= 2:
        cols = shape[-1]
        rows = shape.numel() // cols if cols else 0
        return rows + cols + NUM_SLOTS
    return NUM_SLOTS


def _import_triton() -> ModuleType:
    from . import triton

    return triton


def _import_cpp() -> ModuleType:
    from . import cpp

    return cpp


_registry = BackendRegistry("AdaLomo ", reference, {"triton": _import_triton, "cpp": _import_cpp})
_load = _registry.load
_warned = _registry.warned
_cache = _registry.cache


def resolve(device: torch.device, backend: str | None = None) -> ModuleType:
    """The backend module that runs the AdaLomo passes on tensors of `device`."""
    return _registry.resolve(device, backend)


def backend_name(module: ModuleType) -> str:
    """Short name ('torch', 'cpp', 'triton') of a backend module."""
    return _registry.name_of(module)
