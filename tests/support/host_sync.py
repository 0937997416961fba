"""A guard that fails on any host read of a tensor's values inside its block, and optimizer
steps run under it on the path training takes (the eager fast path).

A TorchDispatchMode cannot be that guard: any mode turns the fast path off
(`lomo_kernels.ops.eager`), and inside a custom op's body the mode is not active. The guard
works below the dispatcher instead: it replaces the CPU (and CUDA) kernel of
``aten::_local_scalar_dense``, which every ``.item()``, ``float(t)``, ``int(t)`` and
``bool(t)`` reaches, from Python or from C++ (a backend's own body included), and patches
the reads that skip the dispatcher (``tolist``, ``numpy``, ``__array__``). On a GPU it also
sets CUDA's sync debug mode to "error", which fails any synchronising device-to-host copy.
"""

from __future__ import annotations

import traceback
import warnings

import torch

from lomo_kernels.ops import eager
from support.models import batch, tiny_llama

# Reads that skip the dispatcher (a CPU tensor's values are read in place).
DIRECT_READS = ("tolist", "numpy", "__array__")


class NoHostSync:
    """Fails on any host read of a tensor's values inside the block (`__doc__` of the
    module); `allowed`: tensors whose reads are not syncs (a pinned host buffer a
    non-blocking copy filled, read once that copy finished). Each read is recorded where
    it happens and fails there; the block fails at its end too, should the error be
    caught on the way."""

    def __init__(self, allowed: tuple[torch.Tensor, ...] = ()) -> None:
        self._allowed = {t.data_ptr() for t in allowed}
        self.reads: list[str] = []

    def _read(self, what: str, tensor: torch.Tensor) -> None:
        if tensor.data_ptr() in self._allowed:
            return
        where = "".join(traceback.format_stack(limit=6)[:-2])
        self.reads.append(f"{what} of a {tuple(tensor.shape)} {tensor.device} tensor\n{where}")
        raise AssertionError(f"host read inside the guarded block: {self.reads[-1]}")

    def __enter__(self) -> NoHostSync:
        self._library = torch.library.Library("aten", "IMPL")

        def scalar_read(tensor):
            self._read("item()/float()/int()/bool()", tensor)

        with warnings.catch_warnings():  # "overriding a previously registered kernel"
            warnings.simplefilter("ignore")
            for key in ("CPU", "CUDA"):
                self._library.impl("_local_scalar_dense", scalar_read, key)
        self._patched = {name: getattr(torch.Tensor, name) for name in DIRECT_READS}
        for name, original in self._patched.items():

            def direct(tensor, *args, _name=name, _original=original, **kwargs):
                self._read(f"{_name}()", tensor)
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, direct)
        self._cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if self._cuda:
            self._debug_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if self._cuda:
            torch.cuda.set_sync_debug_mode(self._debug_mode)
        for name, original in self._patched.items():
            setattr(torch.Tensor, name, original)
        self._library._destroy()  # the original kernels serve again
        if exc_type is None:
            assert not self.reads, "host reads inside the guarded block:\n" + "\n".join(self.reads)


class FastPathCalls:
    """Records, while active, each fused-op call that took the eager fast path (the backend
    kernel run directly, `eager.FusedOp._run_kernel`), by op name, in `calls`."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __enter__(self) -> FastPathCalls:
        self._original = original = eager.FusedOp._kernel
        calls = self.calls

        def _kernel(op, module, device_type):
            kernel = original(op, module, device_type)

            def recorded(*args):
                calls.append(op.overload.name())
                return kernel(*args)

            return recorded

        eager.FusedOp._kernel = _kernel
        return self

    def __exit__(self, *exc) -> None:
        eager.FusedOp._kernel = self._original


def pending_report(opt) -> tuple[torch.Tensor, ...]:
    """The last step's overflow flags a call reads first (reporting.py): on a GPU a pinned
    host buffer a non-blocking copy filled at that step, long finished; not a sync."""
    report = opt._reports._report
    return () if report is None else (report,)


def guarded_fused_backward(opt, loss: torch.Tensor) -> list[str]:
    """`opt.fused_backward(loss)` failing on any host read (`NoHostSync`); returns the
    fast-path calls it made, which must be some: the guard watches the path training takes."""
    with FastPathCalls() as fast, NoHostSync(allowed=pending_report(opt)):
        opt.fused_backward(loss)
    assert fast.calls, "the guarded step took no eager fast path: the guard watched another path"
    return fast.calls


def train_without_host_sync(cls: type, dtype: torch.dtype, steps: int = 3, **options):
    """`steps` steps of `cls` (clipping by value 1.0 and decaying 0.01, `options` besides) on
    support.models.tiny_llama in `dtype`, each fused_backward failing on a host read and
    taking the fast path (the forward may sync: only the optimizer's work is guarded);
    returns (model, optimizer)."""
    model = tiny_llama(dtype)
    opt = cls(model, clip_grad_value=1.0, weight_decay=0.01, **options)
    for step in range(steps):
        guarded_fused_backward(opt, model(**batch(step)).loss)
    return model, opt
