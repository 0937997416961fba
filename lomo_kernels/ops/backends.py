"""Backends of the fused LOMO ops (`sgd_update_`, `grad_sumsq_`) and their selection.

Every backend module implements the signatures of `reference.py`, the executable
specification. Selection rules: `_selection.py`.
"""

from __future__ import annotations

from types import ModuleType

import torch

from . import reference
from ._selection import BACKEND_NAMES, ENV_VAR, BackendRegistry, requested_backend


def _import_triton() -> ModuleType:
    from . import triton_backend

    return triton_backend


def _import_cpp() -> ModuleType:
    from . import cpp_backend

    return cpp_backend


_registry = BackendRegistry("", reference, {"triton": _import_triton, "cpp": _import_cpp})
_load = _registry.load
_warned = _registry.warned
_cache = _registry.cache


def resolve(device: torch.device, backend: str | None = None) -> ModuleType:
    """The backend module that will run the LOMO ops on tensors of `device`."""
    return _registry.resolve(device, backend)


def backend_name(module: ModuleType) -> str:
    """Short name ('torch', 'cpp', 'triton') of a backend module."""
    return _registry.name_of(module)


__all__ = ["BACKEND_NAMES", "ENV_VAR", "backend_name", "requested_backend", "resolve"]
