"""Which kernel runs: the one place that decides, for every fused op on every device.

LOMO update ops and AdaLomo's passes (`LOMO`, `ADALOMO`: a `BackendRegistry` each):
  - order: the caller's ``backend=`` argument, then $LOMO_KERNELS_BACKEND, then the best
    available for the device (`auto_order`):
      cpu:  C++ (csrc/*_cpu.cpp), the reference as fallback; Triton only under
            TRITON_INTERPRET=1 (tests),
      cuda: Triton, then the CUDA C++ kernels (csrc/*_cuda.cu), then the reference;
  - a backend that cannot load never breaks an import or a call: it is reported once with a
    warning and the next one in line is used; the pure-PyTorch reference is always there;
  - the choice is cached per (name, device type, TRITON_INTERPRET).
No schema carries a backend name: a public call resolves its ``backend=`` to a module here
and runs that module's function for the op, directly on the eager fast path (`eager.py`),
or through the dispatcher, whose device kernels (`definition.py`) ask `chosen_backend`
for the call's choice and fall back to the device's. Compiled graphs run the device's.

The fused linear + cross-entropy (`linear_cross_entropy_kernels`): Triton on CUDA where it
loads, else blocked torch operations (CPU, and CUDA without Triton).

Backend modules (kernels/cpp/*.py, kernels/triton/*.py, the references) provide one function
per op, named by its spec's ``function``, taking the spec's arguments by keyword.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import os
import warnings
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

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
    same taking the device type. `importers` maps each backend name ('torch': the reference,
    'triton', 'cpp') to a function importing its module when first asked for, so that this
    file imports no op family (the families define their ops with it) and a broken optional
    dependency is caught here.
    """

    def __init__(self, family: str, importers: dict[str, Callable[[], ModuleType]]) -> None:
        self.family = family
        self.importers = importers
        self.warned: set[tuple[str, str]] = set()
        self.cache: dict[tuple[str, str, str], ModuleType] = {}
        self.names: dict[str, str] = {}

    @property
    def reference(self) -> ModuleType:
        """The family's reference module: the pure-PyTorch backend, always there."""
        module = self.importers["torch"]()
        self.names[module.__name__] = "torch"
        return module

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
            # The backend asked for (first in `order`), or automatic's first.
            if candidate == order[0] and warn_key not in self.warned:
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


# The backend modules (per op family) a call running now chose, for the device kernels the
# dispatcher runs within it.
_CHOSEN: contextvars.ContextVar[dict[Any, ModuleType] | None] = contextvars.ContextVar(
    "lomo_kernels_backend", default=None
)


def chosen_backend(registry: BackendRegistry) -> ModuleType | None:
    """The backend module of `registry`'s family a call running now chose, if any."""
    chosen = _CHOSEN.get()
    return None if chosen is None else chosen.get(registry)


@contextlib.contextmanager
def dispatching_to_modules(chosen: dict[Any, ModuleType]) -> Iterator[None]:
    """Within the block, the ops of each family in `chosen` (registry -> backend module)
    that reach their CPU/CUDA kernels through the dispatcher run that module's kernel."""
    token = _CHOSEN.set(chosen)
    try:
        yield
    finally:
        _CHOSEN.reset(token)


def _imported_on_first_use(modules: dict[str, str]) -> dict[str, Callable[[], ModuleType]]:
    """Backend name -> a function importing that backend's module when first asked for."""
    return {name: functools.partial(importlib.import_module, m) for name, m in modules.items()}


LOMO = BackendRegistry(
    "",
    _imported_on_first_use(
        {
            "torch": "lomo_kernels.ops.lomo.reference",
            "triton": "lomo_kernels.ops.lomo.triton_backend",
            "cpp": "lomo_kernels.ops.lomo.cpp_backend",
        }
    ),
)
ADALOMO = BackendRegistry(
    "AdaLomo ",
    _imported_on_first_use(
        {
            "torch": "lomo_kernels.ops.adalomo.reference",
            "triton": "lomo_kernels.ops.adalomo.triton_backend",
            "cpp": "lomo_kernels.ops.adalomo.cpp_backend",
        }
    ),
)


def resolve(device: torch.device, backend: str | None = None) -> ModuleType:
    """The backend module that runs the LOMO update ops on tensors of `device`."""
    return LOMO.resolve(device, backend)


def backend_name(module: ModuleType) -> str:
    """Short name ('torch', 'cpp', 'triton') of a backend module of either family."""
    for registry in (LOMO, ADALOMO):
        if module.__name__ in registry.names:
            return registry.name_of(module)
    raise KeyError(f"{module.__name__} is not a lomo_kernels backend module")


def dispatching_to(device: torch.device, backend: str | None) -> contextlib.AbstractContextManager:
    """Within the block, every fused op on `device` that goes through the dispatcher (a
    dispatch mode, opcheck) runs `backend` (a name, as ``backend=``) instead of the device's."""
    return dispatching_to_modules({r: r.resolve(device, backend) for r in (LOMO, ADALOMO)})


def linear_cross_entropy_kernels(device: torch.device) -> ModuleType:
    """The fused linear + cross-entropy's kernels for tensors of `device`: Triton on CUDA
    where it loads, else blocked torch operations."""
    if device.type == "cuda":
        from ..kernels.triton import runtime

        if runtime.is_available():
            from .cross_entropy import triton_backend as linear_cross_entropy

            return linear_cross_entropy
    from .cross_entropy import blocked_backend as linear_cross_entropy

    return linear_cross_entropy


__all__ = [
    "ADALOMO",
    "BACKEND_NAMES",
    "ENV_VAR",
    "LOMO",
    "BackendRegistry",
    "backend_name",
    "chosen_backend",
    "dispatching_to",
    "linear_cross_entropy_kernels",
    "requested_backend",
    "resolve",
]
