"""Backend selection: explicit argument, then LOMO_KERNELS_BACKEND, then the best available.

A backend that cannot load never breaks an import or a call: it is reported once with a
warning and the next backend in line is used. The pure-PyTorch backend is always there.
"""

from __future__ import annotations

import os
import warnings
from types import ModuleType

import torch

from . import reference

BACKEND_NAMES = ("triton", "cpp", "torch")
ENV_VAR = "LOMO_KERNELS_BACKEND"

_warned: set[tuple[str, str]] = set()


def _load(name: str, device_type: str) -> tuple[ModuleType | None, str]:
    """The backend module if it serves `device_type`, else None and the reason."""
    if name == "torch":
        return reference, ""
    try:
        if name == "triton":
            from . import triton_backend as module
        else:
            from . import cpp_backend as module
    except Exception as exc:  # a broken optional dependency must not break the package
        return None, f"import failed: {exc!r}"
    if name == "triton":
        if device_type not in ("cuda", "cpu") or not module.is_available():
            return None, module.unavailable_reason()
        if device_type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
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


def requested_backend(backend: str | None) -> str:
    """The backend name asked for by argument or environment ('auto' when neither)."""
    name = backend if backend not in (None, "auto") else os.environ.get(ENV_VAR, "auto")
    name = name.strip().lower() or "auto"
    if name != "auto" and name not in BACKEND_NAMES:
        source = "backend argument" if backend not in (None, "auto") else f"${ENV_VAR}"
        raise ValueError(
            f"unknown lomo_kernels backend {name!r} from the {source}; "
            f"choose one of {', '.join(BACKEND_NAMES)} or 'auto'"
        )
    return name


def resolve(device: torch.device, backend: str | None = None) -> ModuleType:
    """The backend module that will run ops on tensors of `device`."""
    name = requested_backend(backend)
    order = _auto_order(device.type)
    if name != "auto":
        order = (name,) + tuple(n for n in order if n != name)
    for candidate in order:
        module, reason = _load(candidate, device.type)
        if module is not None:
            return module
        key = (candidate, device.type)
        if (name == candidate or candidate == order[0]) and key not in _warned:
            _warned.add(key)
            warnings.warn(
                f"lomo_kernels: backend {candidate!r} unavailable for {device.type} tensors "
                f"({reason}); falling back",
                RuntimeWarning,
                stacklevel=3,
            )
    return reference


def backend_name(module: ModuleType) -> str:
    """Short name of a backend module."""
    return {"reference": "torch", "triton_backend": "triton", "cpp_backend": "cpp"}[
        module.__name__.rsplit(".", 1)[-1]
    ]
