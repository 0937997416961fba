"""Backend selection shared by every op family (the LOMO update ops, the AdaLomo passes).

Order: explicit argument, then $LOMO_KERNELS_BACKEND, then the best available for the device.
A backend that cannot load never breaks an import or a call: it is reported once with a
warning and the next one in line is used. The pure-PyTorch reference is always there.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from types import ModuleType

import torch

BACKEND_NAMES = ("triton", "cpp", "torch")
ENV_VAR = "LOMO_KERNELS_BACKEND"


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


def auto_order(device_type: str) -> tuple[str, ...]:
    if device_type == "cuda":
        return ("triton", "cpp", "torch")
    if device_type == "cpu":
        return ("cpp", "torch")
    return ("torch",)


class BackendRegistry:
    """The backend modules of one op family and the choice among them per device.

    Triton modules provide ``is_available()`` / ``unavailable_reason()``; C++ modules the
    same taking the device type. `importers` maps 'triton' and 'cpp' to functions importing
    the module, so a broken optional dependency is caught here.
    """

    def __init__(
        self, family: str, reference: ModuleType, importers: dict[str, Callable[[], ModuleType]]
    ) -> None:
        self.family = family
        self.reference = reference
        self.importers = importers
        self.warned: set[tuple[str, str]] = set()
        self.cache: dict[tuple[str, str, str], ModuleType] = {}
        self.names = {reference.__name__: "torch"}

    def load(self, name: str, device_type: str) -> tuple[ModuleType | None, str]:
        """The backend module if it serves `device_type`, else None and the reason."""
        if name == "torch":
            return self.reference, ""
        try:
            module = self.importers[name]()
        except Exception as exc:  # a broken optional dependency must not break the package
            return None, f"import failed: {exc!r}"
        self.names[module.__name__] = name
        if name == "triton":
            if device_type not in ("cuda", "cpu"):
                return None, f"no Triton kernels for {device_type} tensors"
            if not module.is_available():
                return None, module.unavailable_reason()
            if device_type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
                return None, "Triton runs on CPU tensors only under TRITON_INTERPRET=1"
            return module, ""
        if not module.is_available(device_type):
            return None, module.unavailable_reason(device_type)
        return module, ""

    def resolve(self, device: torch.device, backend: str | None = None) -> ModuleType:
        """The backend module that runs this family's ops on tensors of `device`."""
        name = requested_backend(backend)
        # TRITON_INTERPRET decides whether Triton serves CPU tensors: part of their key (CUDA
        # tensors exist only where CUDA, hence compiled Triton, is usable; one read saved).
        device_type = device.type
        interpret = os.environ.get("TRITON_INTERPRET", "") if device_type == "cpu" else ""
        key = (name, device_type, interpret)
        cached = self.cache.get(key)
        if cached is not None:
            return cached
        order = auto_order(device.type)
        if name != "auto":
            order = (name,) + tuple(n for n in order if n != name)
        chosen = self.reference
        for candidate in order:
            module, reason = self.load(candidate, device.type)
            if module is not None:
                chosen = module
                break
            warn_key = (candidate, device.type)
            if (name == candidate or candidate == order[0]) and warn_key not in self.warned:
                self.warned.add(warn_key)
                warnings.warn(
                    f"lomo_kernels: {self.family}backend {candidate!r} unavailable for "
                    f"{device.type} tensors ({reason}); falling back (set ${ENV_VAR} to "
                    "choose)",
                    RuntimeWarning,
                    stacklevel=3,
                )
        self.cache[key] = chosen
        return chosen

    def name_of(self, module: ModuleType) -> str:
        """Short name ('torch', 'cpp', 'triton') of one of this family's backend modules."""
        return self.names[module.__name__]
