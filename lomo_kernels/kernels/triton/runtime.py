"""What every Triton launcher needs: availability, interpreter mode, the kernels' view of a
tensor, the kernel arguments several ops share, and the launch itself. Importing this module
never imports triton (a missing triton must not break an import of the package); the
functions do.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from ...core.rounding import rounds_stochastically, seed_parts
from ...core.spec import OpSpec
from .bound_launch import BoundKernels

# Kind codes of the element types the kernels load and store.
KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

# A launch: its grid, and the kernel's arguments by parameter name.
Launch = tuple[tuple[int, ...], dict[str, Any]]


def interpret_mode() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def unavailable_reason() -> str:
    """Why the Triton kernels cannot run here, or "" when they can."""
    try:
        interpreting = interpret_mode()
    except Exception as exc:  # triton missing or broken: fall back, never fail the import
        return f"triton is not importable: {exc!r}"
    if torch.cuda.is_available() or interpreting:
        return ""
    return "no CUDA device and TRITON_INTERPRET is not 1"


def is_available() -> bool:
    """True when triton imports and either CUDA is available or TRITON_INTERPRET=1."""
    return unavailable_reason() == ""


def kernels(name: str) -> ModuleType:
    """The kernel module `name` of this package, re-imported if TRITON_INTERPRET changed
    since it was imported: triton.jit picks interpreter or compiler at decoration time."""
    module = _LOADED.get(name)  # a launch asks each time: no import machinery per call
    if module is None:
        module = _LOADED[name] = importlib.import_module(f"{__package__}.{name}")
    if interpret_mode() != module.DECORATED_FOR_INTERPRETER:
        module = _LOADED[name] = importlib.reload(module)
    return module


_LOADED: dict[str, ModuleType] = {}


def on_device_of(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """The context a launch on `t`'s tensors runs in: Triton launches on the current CUDA
    device and its stream, so a tensor on another device (a model on cuda:1, or spread over
    several GPUs) is launched with that device made current, as the CUDA C++ bindings'
    device guard does."""
    if t.is_cuda and t.get_device() != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def on_first_argument_device(launch: Callable[..., Any]) -> Callable[..., Any]:
    """`launch` (a launcher whose first argument is one of its tensors) run under
    `on_device_of` that tensor; the same parameters (tests/ops/test_op_specs.py reads them)."""

    @functools.wraps(launch)
    def run(*args: Any, **kwargs: Any) -> Any:
        first = args[0] if args else next(iter(kwargs.values()))
        with on_device_of(first):
            return launch(*args, **kwargs)

    return run


def launcher(
    spec: OpSpec, build: Callable[[Any], Launch], kernel: Callable[[], Any], num_warps: int
) -> Callable[..., None]:
    """The launcher of the op of `spec`: one launch of the kernel `kernel()` returns, with the
    grid and the arguments `build` makes of the op's arguments (none for a grid without
    programs). It takes the spec's arguments by position or keyword and hands them to
    `build` as one ``spec.Arguments``, and runs `on_first_argument_device`. `kernel` is
    called at each launch: the kernel module is the one decorated for the current mode.
    On CUDA tensors a specialisation launched before is launched again directly
    (`bound_launch.BoundKernels`)."""
    arguments_of = spec.Arguments
    bound: list[Any] = [None, None]  # the JIT function and its BoundKernels

    def launch(*args: Any, **kwargs: Any) -> None:
        grid, arguments = build(arguments_of(*args, **kwargs))
        if not all(grid):
            return
        jit = kernel()
        first = args[0] if args else next(iter(kwargs.values()))
        if not first.is_cuda or not hasattr(jit, "params"):  # the interpreter's CPU tensors
            jit[grid](**arguments, num_warps=num_warps)
            return
        if bound[0] is not jit:
            bound[:] = [jit, BoundKernels(jit.params, num_warps)]
        bound[1].launch(jit, grid, arguments, first.get_device())

    launch.__name__ = launch.__qualname__ = spec.function
    launch.__doc__ = build.__doc__
    launch.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in spec.names]
    )
    launch.bound = bound  # type: ignore[attr-defined]  # [JIT function, BoundKernels]: tests
    return on_first_argument_device(launch)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of non-negative integers."""
    return -(-a // b)


def storage(t: torch.Tensor) -> torch.Tensor:
    """The tensor the kernels address: bf16 as its int16 bit patterns."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def param_kwargs(param: torch.Tensor) -> dict[str, Any]:
    """The parameter's arguments of a kernel that loads (and writes) it."""
    return {"param_ptr": storage(param), "PARAM_KIND": KIND[param.dtype]}


def grad_kwargs(
    grad: torch.Tensor, inv_scale: torch.Tensor | None, clip_value: float | None
) -> dict[str, Any]:
    """The gradient's arguments: its storage and `transform_kwargs`."""
    return {
        "grad_ptr": storage(grad),
        "GRAD_KIND": KIND[grad.dtype],
        **transform_kwargs(inv_scale, clip_value),
    }


def transform_kwargs(inv_scale: torch.Tensor | None, clip_value: float | None) -> dict[str, Any]:
    """The gradient transform's arguments: the unscaling factor (None: 1, compiled out) and
    the clamp bound (clipping by value compiled in only when there is one)."""
    return {
        "inv_scale_ptr": inv_scale,
        "clip_value": 0.0 if clip_value is None else float(clip_value),
        "HAS_CLIP_VALUE": clip_value is not None,
    }


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def snapshot_skip_flag(skip_if: torch.Tensor | None, found_inf: torch.Tensor | None):
    """skip_if, copied when it shares storage with found_inf: programs of one launch must not
    read a found_inf a sibling program has already raised as their skip flag."""
    if skip_if is not None and found_inf is not None and same_storage(skip_if, found_inf):
        return skip_if.clone()
    return skip_if


def _int32_bits(value: int) -> int:
    """A uint32 passed as int32 bits: one kernel signature for every value."""
    return value - (1 << 32) if value >= (1 << 31) else value


def rounding_args(
    param: torch.Tensor, stochastic_rounding: bool, seed: int
) -> tuple[bool, int, int]:
    """(STOCHASTIC_ROUNDING, seed_lo, seed_hi) of a launch writing `param`: stochastic rounding
    applies to bf16 and fp16 parameters (fp32 stores the result exactly, as in the
    references), the seed's halves (`_rounding.seed_parts`) as int32 bits; the kernel adds
    the per-step value (`rounding_kernels.rounding_key`)."""
    stochastic = _rounds(param, stochastic_rounding)
    return (stochastic, *_seed_bits(stochastic, seed))


def _rounds(param: torch.Tensor, stochastic_rounding: bool) -> bool:
    """Whether a write-back into `param` rounds stochastically (bf16 and fp16 only)."""
    return bool(stochastic_rounding) and rounds_stochastically(param.dtype)


def _seed_bits(stochastic: bool, seed: int) -> tuple[int, int]:
    """The seed's halves as int32 bits (zeros when the rounding is not stochastic)."""
    seed_lo, seed_hi = seed_parts(seed) if stochastic else (0, 0)
    return _int32_bits(seed_lo), _int32_bits(seed_hi)


def stochastic_kwargs(
    stochastic: bool, seed: int, seed_step: torch.Tensor | None
) -> dict[str, Any]:
    """A rounding's arguments: the seed's halves (`rounding_args`) and the per-step value,
    read on the device and passed only when the rounding is stochastic."""
    seed_lo, seed_hi = _seed_bits(stochastic, seed)
    return {
        "seed_lo": seed_lo,
        "seed_hi": seed_hi,
        "seed_step_ptr": seed_step if stochastic else None,
        "STOCHASTIC_ROUNDING": stochastic,
    }


def rounding_kwargs(
    param: torch.Tensor, stochastic_rounding: bool, seed: int, seed_step: torch.Tensor | None
) -> dict[str, Any]:
    """The write-back's rounding arguments (`rounding_args`, `stochastic_kwargs`)."""
    return stochastic_kwargs(_rounds(param, stochastic_rounding), seed, seed_step)
