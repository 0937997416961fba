"""torch's private names that only the benchmarks read (the package's own are in
lomo_kernels/core/torch_internals.py), looked up when first needed, with the same
`MissingInternalError` naming the name and what to do when a release drops one."""

from __future__ import annotations

from collections.abc import Callable

import torch

from lomo_kernels.core.torch_internals import MissingInternalError


def torch_fused_sgd() -> Callable[..., None]:
    """torch's fused SGD kernel (``torch.optim.SGD(fused=True)`` runs it)."""
    fused = getattr(torch, "_fused_sgd_", None)
    if fused is None:
        raise MissingInternalError(
            "torch._fused_sgd_", "leave the torch fused-SGD variant out of the benchmark"
        )
    return fused


def cuda_spin(cycles: int) -> None:
    """Keeps the current CUDA stream busy for about `cycles` GPU clock cycles."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is None:
        raise MissingInternalError(
            "torch.cuda._sleep", "GPU timings need it: use a torch release that has it"
        )
    sleep(cycles)
