"""C++ (CPU) and CUDA backend: torch extensions built from ``csrc/`` on first use.

Same signatures and semantics as :mod:`lomo_kernels.backends.reference`. Nothing is built
at import time; a failed build is recorded (see :func:`unavailable_reason`) and never raises
from :func:`is_available`, so the dispatcher can warn once and fall back.

``LOMO_KERNELS_PREBUILT=1`` imports ``lomo_kernels._C_cpu`` (built by ``setup.py`` with
``LOMO_KERNELS_BUILD_EXT=1``) instead of JIT-building the CPU extension.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch

from .._rounding import seed_key

_CSRC = Path(__file__).resolve().parent.parent / "csrc"
_MAX_REASON_CHARS = 4000

_lock = threading.Lock()
_modules: dict[str, ModuleType] = {}
_errors: dict[str, str] = {}


def cpu_build_flags() -> list[list[str]]:
    """Compiler flag sets for the CPU extension, tried in order until one builds.

    -ffp-contract=off keeps the reference's per-op fp32 rounding (no FMA contraction);
    -fno-trapping-math lets GCC turn the float selects of the hot loop into vector blends;
    -fopenmp enables at::parallel_for (its OpenMP body lives in a header).
    """
    if sys.platform == "win32":
        return [["/O2", "/openmp"], ["/O2"]]
    base = ["-O3", "-fno-trapping-math", "-ffp-contract=off"]
    return [base + ["-march=native", "-fopenmp"], base + ["-fopenmp"], base]


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= _MAX_REASON_CHARS else "..." + text[-_MAX_REASON_CHARS:]


def _build_cpu() -> ModuleType:
    if os.environ.get("LOMO_KERNELS_PREBUILT") == "1":
        return importlib.import_module("lomo_kernels._C_cpu")
    from torch.utils.cpp_extension import load

    failures = []
    for flags in cpu_build_flags():
        ldflags = ["-fopenmp"] if "-fopenmp" in flags else []  # MSVC links OpenMP itself
        try:
            return load(
                name="lomo_kernels_cpu",
                sources=[str(_CSRC / "lomo_cpu.cpp")],
                extra_cflags=flags,
                extra_ldflags=ldflags,
                verbose=False,
            )
        except Exception as exc:  # noqa: BLE001 - any build error means "unavailable"
            failures.append(f"flags {flags}: {_short(exc)}")
    raise RuntimeError("C++ extension build failed:\n" + "\n".join(failures))


def _build_cuda() -> ModuleType:
    if torch.version.cuda is None:
        raise RuntimeError("this torch build has no CUDA support")
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device is available")
    from torch.utils.cpp_extension import load

    return load(
        name="lomo_kernels_cuda",
        sources=[str(_CSRC / "lomo_cuda.cu"), str(_CSRC / "lomo_cuda_binding.cpp")],
        extra_cflags=["-O3"],
        # No --use_fast_math: it would flush subnormals and break bit-exactness.
        extra_cuda_cflags=["-O3"],
        verbose=False,
    )


def _load(device_type: str) -> ModuleType | None:
    module = _modules.get(device_type)
    if module is not None or device_type in _errors:
        return module
    with _lock:
        if device_type in _modules:
            return _modules[device_type]
        if device_type in _errors:
            return None
        try:
            if device_type == "cpu":
                module = _build_cpu()
            elif device_type == "cuda":
                module = _build_cuda()
            else:
                raise RuntimeError(f"no C++ kernels for device type {device_type!r}")
        except Exception as exc:  # noqa: BLE001 - recorded, reported by unavailable_reason
            _errors[device_type] = _short(exc)
            return None
        _modules[device_type] = module
        return module


def is_available(device_type: str) -> bool:
    """True when the extension for ``device_type`` ('cpu' or 'cuda') is built and loaded.

    The first call builds it (about a minute for the CPU one); failures are recorded.
    """
    return _load(device_type) is not None


def unavailable_reason(device_type: str) -> str:
    """Why :func:`is_available` is False for ``device_type`` ('' when it is available)."""
    if _load(device_type) is not None:
        return ""
    return _errors.get(device_type, "unknown")


def _device_type(t: torch.Tensor) -> str:
    # Tensor.is_cuda is several times cheaper than Tensor.device.type (per-call overhead).
    return "cuda" if t.is_cuda else ("cpu" if t.is_cpu else t.device.type)


def _module(device_type: str) -> ModuleType:
    module = _modules.get(device_type)
    if module is None:
        module = _load(device_type)
        if module is None:
            raise RuntimeError(
                f"lomo_kernels C++ backend unavailable for {device_type}: "
                f"{_errors.get(device_type, 'unknown')}"
            )
    return module


def sgd_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    *,
    lr: float,
    lr_tensor: torch.Tensor | None,
    inv_scale: float,
    inv_scale_tensor: torch.Tensor | None,
    clip_value: float | None,
    clip_coef: float,
    clip_coef_tensor: torch.Tensor | None,
    weight_decay: float,
    found_inf: torch.Tensor | None,
    skip_if: torch.Tensor | None,
    stochastic_rounding: bool,
    seed: int,
) -> None:
    """One fused LOMO step on one contiguous parameter, in place (see reference.sgd_update_)."""
    # The key only matters where stochastic rounding applies; skip the hash otherwise.
    key = seed_key(seed) if stochastic_rounding and param.dtype == torch.bfloat16 else 0
    _module(_device_type(param)).sgd_update_(
        param,
        grad,
        float(lr),
        lr_tensor,
        float(inv_scale),
        inv_scale_tensor,
        None if clip_value is None else float(clip_value),
        float(clip_coef),
        clip_coef_tensor,
        float(weight_decay),
        found_inf,
        skip_if,
        bool(stochastic_rounding),
        key,
    )


def grad_sumsq_(
    grad: torch.Tensor,
    *,
    inv_scale: float,
    inv_scale_tensor: torch.Tensor | None,
    sumsq: torch.Tensor,
    found_inf: torch.Tensor | None,
) -> None:
    """sumsq += sum((fp32(grad) * inv_scale) ** 2); found_inf = 1 on inf/nan (in place)."""
    _module(_device_type(grad)).grad_sumsq_(
        grad, float(inv_scale), inv_scale_tensor, sumsq, found_inf
    )
