"""Builds the C++/CUDA torch extensions from ``csrc/`` on first use, once per process.

Nothing is built at import time. A failed build is recorded and reported by
`ExtensionLoader.unavailable_reason`, never raised from `is_available`, so the dispatchers
can warn once and fall back. torch.utils.cpp_extension caches builds across processes.
"""

from __future__ import annotations

import importlib
import os
import platform
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

# The package ships csrc/ (lomo_kernels/csrc, a link to the top-level sources in a checkout).
CSRC = Path(__file__).resolve().parents[2] / "csrc"
_MAX_REASON_CHARS = 4000
# platform.machine() of x86 hosts, whose CPU extensions dispatch by CPU feature at run time.
X86_MACHINES = ("x86_64", "amd64", "i386", "i686")


# With this set to 1 the extensions are imported as built ahead of time by setup.py
# (LOMO_KERNELS_BUILD_EXT=1), as `lomo_kernels.<name>`, instead of JIT-built.
PREBUILT_ENV = "LOMO_KERNELS_PREBUILT"

# Every extension: its name and sources (setup.py builds these when asked to).
EXTENSIONS = {
    "lomo_kernels_cpu": ("lomo_cpu.cpp",),
    "lomo_kernels_cuda": ("lomo_cuda.cu", "lomo_cuda_binding.cpp"),
    "lomo_kernels_adalomo_cpu": ("adalomo_cpu.cpp",),
    "lomo_kernels_adalomo_cuda": ("adalomo_cuda.cu", "adalomo_cuda_binding.cpp"),
}


def prebuilt_name(name: str) -> str:
    """The module an extension built ahead of time is imported as."""
    return f"lomo_kernels._C_{name.removeprefix('lomo_kernels_')}"


def device_type(t: torch.Tensor) -> str:
    """'cpu' or 'cuda': which extension serves `t`."""
    # Tensor.is_cuda is several times cheaper than Tensor.device.type (per-call overhead).
    return "cuda" if t.is_cuda else ("cpu" if t.is_cpu else t.device.type)


def cpu_build_flags() -> list[list[str]]:
    """Compiler flag sets for a CPU extension, tried in order until one builds.

    x86-64 builds for the baseline ISA: the kernels pick their AVX2 or AVX-512 loops at run
    time from the CPU's features (csrc/cpu_isa.h), so one build runs on any x86-64 and the
    LOMO_KERNELS_CPU_ISA levels can be compared on one machine. Elsewhere -march=native: the
    extension is built on the machine that runs it (first use);
    -ffp-contract=off keeps the reference's per-operation fp32 rounding (no FMA), so the
    vector width changes speed, not results;
    -fno-trapping-math lets GCC turn the float selects of the hot loops into vector blends;
    -fopenmp backs at::parallel_for (its OpenMP body lives in a header).
    """
    if sys.platform == "win32":
        return [["/O2", "/openmp"], ["/O2"]]
    base = ["-O3", "-fno-trapping-math", "-ffp-contract=off"]
    if platform.machine().lower() in X86_MACHINES:
        return [base + ["-fopenmp"], base]
    return [base + ["-march=native", "-fopenmp"], base + ["-fopenmp"], base]


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= _MAX_REASON_CHARS else "..." + text[-_MAX_REASON_CHARS:]


class ExtensionLoader:
    """One CPU and one CUDA extension of a backend, each built at most once per process."""

    def __init__(self, label: str, cpu: str, cuda: str) -> None:
        self.label = label
        self._cpu_name, self._cpu_sources = cpu, EXTENSIONS[cpu]
        self._cuda_name, self._cuda_sources = cuda, EXTENSIONS[cuda]
        self._lock = threading.Lock()
        self._modules: dict[str, ModuleType] = {}
        self._errors: dict[str, str] = {}

    def _build_cpu(self) -> ModuleType:
        if os.environ.get(PREBUILT_ENV) == "1":
            return importlib.import_module(prebuilt_name(self._cpu_name))
        from torch.utils.cpp_extension import load

        failures = []
        for flags in cpu_build_flags():
            ldflags = [f for f in flags if f == "-fopenmp"]  # MSVC links OpenMP itself
            try:
                return load(
                    name=self._cpu_name,
                    sources=[str(CSRC / s) for s in self._cpu_sources],
                    extra_include_paths=[str(CSRC)],
                    extra_cflags=flags,
                    extra_ldflags=ldflags,
                    verbose=False,
                )
            except Exception as exc:  # any build error means "unavailable"
                failures.append(f"flags {flags}: {_short(exc)}")
        raise RuntimeError(f"{self.label} build failed:\n" + "\n".join(failures))

    def _build_cuda(self) -> ModuleType:
        if torch.version.cuda is None:
            raise RuntimeError("this torch build has no CUDA support")
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device is available")
        if os.environ.get(PREBUILT_ENV) == "1":
            return importlib.import_module(prebuilt_name(self._cuda_name))
        from torch.utils.cpp_extension import load

        return load(
            name=self._cuda_name,
            sources=[str(CSRC / s) for s in self._cuda_sources],
            extra_include_paths=[str(CSRC)],
            extra_cflags=["-O3"],
            # No --use_fast_math: it would flush subnormals and change the fp32 rounding.
            extra_cuda_cflags=["-O3"],
            verbose=False,
        )

    def get(self, device_type: str) -> ModuleType | None:
        """The loaded extension for `device_type`, building it on first use; None if it fails."""
        module = self._modules.get(device_type)
        if module is not None or device_type in self._errors:
            return module
        with self._lock:
            if device_type in self._modules:
                return self._modules[device_type]
            if device_type in self._errors:
                return None
            try:
                if device_type == "cpu":
                    module = self._build_cpu()
                elif device_type == "cuda":
                    module = self._build_cuda()
                else:
                    raise RuntimeError(f"no C++ kernels for device type {device_type!r}")
            except Exception as exc:  # recorded, reported by unavailable_reason
                self._errors[device_type] = _short(exc)
                return None
            self._modules[device_type] = module
            return module

    def is_available(self, device_type: str) -> bool:
        """True when the extension for `device_type` ('cpu' or 'cuda') builds and loads."""
        return self.get(device_type) is not None

    def unavailable_reason(self, device_type: str) -> str:
        """Why `is_available` is False for `device_type` ('' when it is available)."""
        if self.get(device_type) is not None:
            return ""
        return self._errors.get(device_type, "unknown")

    def function(self, name: str) -> Callable[..., None]:
        """The extension function `name`, run on the extension of the device of the call's
        first argument; arguments by position or keyword (the binding's declared names)."""

        modules = self._modules

        def for_device(kind: str) -> Callable[..., None]:
            """The function of the extension for device type `kind` (built on first use)."""
            return getattr(modules.get(kind) or self.module(kind), name)

        def call(*args: Any, **kwargs: Any) -> None:
            first = args[0] if args else next(iter(kwargs.values()))
            for_device(device_type(first))(*args, **kwargs)

        call.for_device = for_device  # type: ignore[attr-defined]
        call.__name__ = call.__qualname__ = name
        call.__doc__ = f"The extension's {name} on the tensors' device (csrc/ bindings)."
        return call

    def module(self, device_type: str) -> ModuleType:
        """The extension for `device_type`, or a RuntimeError saying why it is missing."""
        module = self._modules.get(device_type) or self.get(device_type)
        if module is None:
            raise RuntimeError(
                f"lomo_kernels {self.label} unavailable for {device_type}: "
                f"{self._errors.get(device_type, 'unknown')}"
            )
        return module
