"""Launching a Triton kernel already compiled for a launch's specialisation, without the JIT
launcher's per-call work.

Triton's ``kernel[grid](...)`` (``JITFunction.run``) costs tens of microseconds of host time
per launch: it binds the arguments to the signature, asks for each argument's specialisation,
builds a string cache key, looks the device and stream up, checks the kernel's global values
and prepares launch metadata. The optimizers launch a kernel per parameter inside backward,
so on a small parameter that host time exceeds the kernel's own.

`BoundKernels` keeps, per specialisation, the ``CompiledKernel`` the JIT returned for the
first launch of it, and launches it again through ``CompiledKernel.run``, the launcher the
JIT calls last, with the same arguments in the same order. Its key is at least as fine as the
JIT's specialisation, so the kernel it finds is the one the JIT would pick
(tests/kernels/test_bound_launch.py holds the key against Triton's own rules): each
constexpr's value and, for each runtime argument, its type, a tensor's dtype and 16-byte
alignment, an int's being 1, its divisibility by 16 and its integer type's range. Anything
else, launch hooks (a profiler) or a new specialisation goes through the JIT.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...core.torch_internals import triton_current_stream

Key = tuple[Any, ...]


def _int_range(value: int) -> int:
    """Which integer type Triton gives `value`: 0 i32, 1 i64, 2 u64."""
    if -(2**31) <= value < 2**31:
        return 0
    return 1 if -(2**63) <= value < 2**63 else 2


def runtime_key(value: Any) -> Key:
    """What of a runtime (non-constexpr) argument can change the JIT's specialisation."""
    kind = type(value)
    if kind is torch.Tensor or isinstance(value, torch.Tensor):  # the common case first
        return (value.dtype, value.data_ptr() % 16 == 0)
    if kind is int:
        return (int, value == 1, value % 16 == 0, _int_range(value))
    if kind is float:
        return (float,)  # fp32, never specialised
    if value is None or kind is bool:
        return (kind, value)
    raise TypeError(f"no bound-launch key for a {kind.__name__} argument")


def _items(positions: Sequence[Any]) -> Callable[[Any], tuple[Any, ...]]:
    """The items at `positions` (indices of a sequence, or keys of a dict) as a tuple (an
    itemgetter of one position returns the item itself)."""
    if len(positions) == 1:
        return lambda values: (values[positions[0]],)
    return operator.itemgetter(*positions) if positions else lambda values: ()


class BoundKernels:
    """The compiled kernels of one Triton kernel, by specialisation, launched directly.

    `launch(jit, grid, arguments, device)`: `arguments` by parameter name, every parameter
    of the kernel given (a launcher that leaves one to its default is always launched
    through the JIT); `device`: the CUDA device index the launch runs on (current).
    """

    def __init__(self, params: Sequence[Any], num_warps: int) -> None:
        self.arg_names = tuple(p.name for p in params)
        self._values = _items(self.arg_names)  # of the arguments, by name, in order
        self._constexpr = _items([i for i, p in enumerate(params) if p.is_constexpr])
        self._runtime = _items([i for i, p in enumerate(params) if not p.is_constexpr])
        self.num_warps = num_warps
        self.compiled: dict[Key, Any] = {}
        self._stream: Callable[[int], int] | None = None
        self._hooks: Any = None
        self.refused: TypeError | None = None  # the launcher's refusal of our arguments

    def key(self, values: Sequence[Any], device: int) -> Key:
        return (device, self._constexpr(values), *map(runtime_key, self._runtime(values)))

    def launch(
        self, jit: Any, grid: tuple[int, ...], arguments: dict[str, Any], device: int
    ) -> None:
        try:
            values = self._values(arguments)
            key = self.key(values, device)
        except (KeyError, TypeError):
            self._through_jit(jit, grid, arguments)
            return
        compiled = self.compiled.get(key)
        if compiled is None or self.refused is not None or self._hooked():
            launched = self._through_jit(jit, grid, arguments)
            if compiled is None and launched is not None:
                self.compiled[key] = launched
            return
        if self._stream is None:
            self._stream = triton_current_stream()
            if self._stream is None:
                self._through_jit(jit, grid, arguments)
                return
        try:
            compiled.run(
                grid[0],
                grid[1] if len(grid) > 1 else 1,
                grid[2] if len(grid) > 2 else 1,
                self._stream(device),
                compiled.function,
                compiled.packed_metadata,
                None,  # launch metadata: only for launch hooks, which take the JIT path
                None,
                None,
                *values,
            )
        except TypeError as error:
            # A triton whose launcher takes its arguments otherwise refuses them before
            # launching: from then on every launch goes through the JIT.
            self.refused = error
            warnings.warn(
                f"triton {_triton_version()}'s compiled-kernel launcher refused the direct "
                f"launch ({error}); launching through the JIT from now on (more host time "
                "per call)",
                RuntimeWarning,
                stacklevel=2,
            )
            self._through_jit(jit, grid, arguments)

    def _through_jit(self, jit: Any, grid: tuple[int, ...], arguments: dict[str, Any]) -> Any:
        """Triton's own launch (compiling the specialisation if new); its compiled kernel."""
        return jit[grid](**arguments, num_warps=self.num_warps)

    def _hooked(self) -> bool:
        """Whether a launch hook is set (a profiler such as proton reads every launch): a
        hook chain with calls in it, or a hook function. Without one the launcher is given
        None for the hooks and their metadata, which it skips as it does an empty chain."""
        if self._hooks is None:
            import triton

            self._hooks = triton.knobs.runtime
        return _active(self._hooks.launch_enter_hook) or _active(self._hooks.launch_exit_hook)


def _triton_version() -> str:
    import triton

    return str(getattr(triton, "__version__", "?"))


def _active(hook: Any) -> bool:
    return bool(getattr(hook, "calls", hook))
