"""C++ (CPU) and CUDA backend of the AdaLomo passes: torch extensions built on first use.

Same signatures and semantics as `reference.py`. Nothing is built at import time; a failed
build is recorded and reported by `unavailable_reason`, never raised, so the dispatcher can
warn once and fall back. torch.utils.cpp_extension caches the build (keyed by the sources),
so later processes only load it.

CPU: `csrc/adalomo_cpu.cpp`. CUDA: `csrc/adalomo_cuda.cu` (kernels and `extern "C"`
launchers, buildable by nvcc alone) plus `csrc/adalomo_cuda_binding.cpp`, which needs a
CUDA build of torch.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from types import ModuleType

import torch

_CSRC = Path(__file__).resolve().parent.parent / "csrc"
_MAX_REASON_CHARS = 4000

_lock = threading.Lock()
_modules: dict[str, ModuleType] = {}
_errors: dict[str, str] = {}


def cpu_build_flags() -> list[list[str]]:
    """Compiler flag sets for the CPU extension, tried in order until one builds.

    -ffp-contract=off keeps the reference's per-operation fp32 rounding (no FMA);
    -fno-trapping-math lets the float selects vectorise; -fopenmp backs at::parallel_for.
    """
    if sys.platform == "win32":
        return [["/O2", "/openmp"], ["/O2"]]
    base = ["-O3", "-fno-trapping-math", "-ffp-contract=off"]
    return [base + ["-fopenmp"], base]


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= _MAX_REASON_CHARS else "..." + text[-_MAX_REASON_CHARS:]


def _build_cpu() -> ModuleType:
    from torch.utils.cpp_extension import load

    failures = []
    for flags in cpu_build_flags():
        ldflags = [f for f in flags if f in ("-fopenmp", "/openmp")]
        try:
            return load(
                name="lomo_kernels_adalomo_cpu",
                sources=[str(_CSRC / "adalomo_cpu.cpp")],
                extra_include_paths=[str(_CSRC)],
                extra_cflags=flags,
                extra_ldflags=ldflags,
                verbose=False,
            )
        except Exception as exc:  # any build error means "unavailable"
            failures.append(f"flags {flags}: {_short(exc)}")
    raise RuntimeError("AdaLomo C++ extension build failed:\n" + "\n".join(failures))


def _build_cuda() -> ModuleType:
    if torch.version.cuda is None:
        raise RuntimeError("this torch build has no CUDA support")
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device is available")
    from torch.utils.cpp_extension import load

    return load(
        name="lomo_kernels_adalomo_cuda",
        sources=[str(_CSRC / "adalomo_cuda.cu"), str(_CSRC / "adalomo_cuda_binding.cpp")],
        extra_include_paths=[str(_CSRC)],
        extra_cflags=["-O3"],
        # No --use_fast_math: it would flush subnormals and loosen the fp32 rounding.
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
        except Exception as exc:  # recorded, reported by unavailable_reason
            _errors[device_type] = _short(exc)
            return None
        _modules[device_type] = module
        return module


def is_available(device_type: str) -> bool:
    """True when the extension for `device_type` ('cpu' or 'cuda') is built and loaded.

    The first call builds it (about a minute for the CPU one); failures are recorded.
    """
    return _load(device_type) is not None


def unavailable_reason(device_type: str) -> str:
    """Why `is_available` is False for `device_type` ('' when it is available)."""
    if _load(device_type) is not None:
        return ""
    return _errors.get(device_type, "unknown")


def _module(device_type: str) -> ModuleType:
    module = _modules.get(device_type) or _load(device_type)
    if module is None:
        raise RuntimeError(
            f"lomo_kernels AdaLomo C++ backend unavailable for {device_type}: "
            f"{_errors.get(device_type, 'unknown')}"
        )
    return module


def _opt(value: float | None) -> float | None:
    return None if value is None else float(value)


def factored_stats_(
    grad: torch.Tensor,
    param: torch.Tensor,
    workspace: torch.Tensor,
    found_inf: torch.Tensor | None,
    skip_if: torch.Tensor | None,
    *,
    cols: int,
    inv_scale: float,
    inv_scale_tensor: torch.Tensor | None,
    clip_value: float | None,
    clip_coef: float,
    clip_coef_tensor: torch.Tensor | None,
    eps0: float,
) -> None:
    """Pass A (see `reference.factored_stats_`)."""
    _module(grad.device.type).factored_stats_(
        grad,
        param,
        workspace,
        found_inf,
        skip_if,
        int(cols),
        float(inv_scale),
        inv_scale_tensor,
        _opt(clip_value),
        float(clip_coef),
        clip_coef_tensor,
        float(eps0),
    )


def factored_moments_(
    exp_avg_sq_row: torch.Tensor,
    exp_avg_sq_col: torch.Tensor,
    workspace: torch.Tensor,
    *,
    beta2: float,
    beta2_tensor: torch.Tensor | None,
) -> None:
    """Row/column moments and sum(R) (see `reference.factored_moments_`)."""
    _module(workspace.device.type).factored_moments_(
        exp_avg_sq_row, exp_avg_sq_col, workspace, float(beta2), beta2_tensor
    )


def factored_norm_(
    grad: torch.Tensor,
    exp_avg_sq_row: torch.Tensor,
    exp_avg_sq_col: torch.Tensor,
    workspace: torch.Tensor,
    *,
    inv_scale: float,
    inv_scale_tensor: torch.Tensor | None,
    clip_value: float | None,
    clip_coef: float,
    clip_coef_tensor: torch.Tensor | None,
) -> None:
    """Pass B (see `reference.factored_norm_`)."""
    _module(grad.device.type).factored_norm_(
        grad,
        exp_avg_sq_row,
        exp_avg_sq_col,
        workspace,
        float(inv_scale),
        inv_scale_tensor,
        _opt(clip_value),
        float(clip_coef),
        clip_coef_tensor,
    )


def factored_apply_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg_sq_row: torch.Tensor,
    exp_avg_sq_col: torch.Tensor,
    workspace: torch.Tensor,
    *,
    lr: float,
    lr_tensor: torch.Tensor | None,
    eps1: float,
    clip_threshold: float,
    weight_decay: float,
    inv_scale: float,
    inv_scale_tensor: torch.Tensor | None,
    clip_value: float | None,
    clip_coef: float,
    clip_coef_tensor: torch.Tensor | None,
) -> None:
    """Pass C (see `reference.factored_apply_`)."""
    _module(param.device.type).factored_apply_(
        param,
        grad,
        exp_avg_sq_row,
        exp_avg_sq_col,
        workspace,
        float(lr),
        lr_tensor,
        float(eps1),
        float(clip_threshold),
        float(weight_decay),
        float(inv_scale),
        inv_scale_tensor,
        _opt(clip_value),
        float(clip_coef),
        clip_coef_tensor,
    )


def vector_stats_(
    grad: torch.Tensor,
    param: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    workspace: torch.Tensor,
    found_inf: torch.Tensor | None,
    skip_if: torch.Tensor | None,
    *,
    beta2: float,
    beta2_tensor: torch.Tensor | None,
    eps0: float,
    inv_scale: float,
    inv_scale_tensor: torch.Tensor | None,
    clip_value: float | None,
    clip_coef: float,
    clip_coef_tensor: torch.Tensor | None,
) -> None:
    """Pass A1 (see `reference.vector_stats_`)."""
    _module(grad.device.type).vector_stats_(
        grad,
        param,
        exp_avg_sq,
        workspace,
        found_inf,
        skip_if,
        float(beta2),
        beta2_tensor,
        float(eps0),
        float(inv_scale),
        inv_scale_tensor,
        _opt(clip_value),
        float(clip_coef),
        clip_coef_tensor,
    )


def vector_apply_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    workspace: torch.Tensor,
    *,
    beta2: float,
    beta2_tensor: torch.Tensor | None,
    eps0: float,
    lr: float,
    lr_tensor: torch.Tensor | None,
    eps1: float,
    clip_threshold: float,
    weight_decay: float,
    inv_scale: float,
    inv_scale_tensor: torch.Tensor | None,
    clip_value: float | None,
    clip_coef: float,
    clip_coef_tensor: torch.Tensor | None,
) -> None:
    """Pass C1 (see `reference.vector_apply_`)."""
    _module(param.device.type).vector_apply_(
        param,
        grad,
        exp_avg_sq,
        workspace,
        float(beta2),
        beta2_tensor,
        float(eps0),
        float(lr),
        lr_tensor,
        float(eps1),
        float(clip_threshold),
        float(weight_decay),
        float(inv_scale),
        inv_scale_tensor,
        _opt(clip_value),
        float(clip_coef),
        clip_coef_tensor,
    )
