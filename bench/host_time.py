"""`python -m bench.host_time`: host time of one LOMO update call on a small tensor, the
ways a program makes it.

    python -m bench.host_time [--device cpu|cuda] [--numel N] [--dtype bf16|fp16|fp32]
                                 [--backend cpp|triton|torch] [--reps R] [--calls C] [--json F]

Rows, timed interleaved in one process (MEASURING.md: ratios from one run):
  public (name)      ops.fused_lomo_update_(..., backend="<name>"): every argument checked
                     and converted, the backend resolved by name
  public (module)    the same with a backend module resolved once (ops.backends.resolve)
  Lomo per tensor    what Lomo runs for one parameter inside backward (its hook's `_update`)
  AdaLomo per tensor the same for AdaLomo (its passes, several op calls)
  kernel alone       the backend's kernel called as the eager fast path calls it, with the
                     public call's arguments: the floor of any call through lomo_kernels
  p.add_             torch's own in-place axpy, the floor of one eager call

A row is the minimum over R repetitions of C back-to-back calls (CUDA: synchronised at the
end of each repetition, so the figure is the host's enqueue rate once the queue is full).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch

from lomo_kernels import AdaLomo, Lomo
from lomo_kernels.ops import fused_lomo_update_
from lomo_kernels.ops.backends import BACKEND_NAMES, resolve
from lomo_kernels.ops.lomo import LOMO_UPDATE, lomo_update_op
from lomo_kernels.optim.piece import Piece

from .common import machine
from .common.argtypes import (
    add_counts,
    add_device_argument,
    add_json_argument,
)
from .common.dtypes import DTYPES
from .common.timing import WallClock, time_interleaved

FLOOR = "p.add_"


def per_tensor(cls: type, param: torch.Tensor, backend: str) -> Callable[[], None]:
    """The update an optimizer's hook makes of `param` (`_update`, after one real step set the
    optimizer up), from a fixed gradient."""
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(param)
    optimizer = cls(model, lr=1e-3, clip_grad_norm=None, backend=backend)
    optimizer.fused_backward(model.weight.float().pow(2).sum(), lr=1e-3)
    weight = model.weight
    index, group = optimizer._groups.of(weight)
    scalars = optimizer._scalars.for_device(weight.device)
    grad = torch.randn_like(weight)
    step = Piece(weight, grad, index, group, scalars, scalars.update_found_inf)
    return lambda: optimizer._update(step)


def as_matrix(param: torch.Tensor) -> torch.Tensor:
    """`param` as a 64-row matrix where its size allows: AdaLomo's factored statistics, its
    passes over rows and columns."""
    return param.view(64, -1) if param.numel() % 64 == 0 else param


def kernel_alone(
    module: object, param: torch.Tensor, grad: torch.Tensor, lr: torch.Tensor, flag: torch.Tensor
) -> Callable[[], None]:
    """The kernel the fast path runs for `module`, given what the public call below passes
    (its floats converted as the public function converts them)."""
    kernel = lomo_update_op._kernel(module, param.device.type)
    given = {"param": param, "grad": grad, "lr": lr, "found_inf": flag, "skip_if": flag}
    defaults = {"weight_decay": 0.0, "stochastic_rounding": False, "seed": 0, "offset": 0}
    args = tuple(given.get(name, defaults.get(name)) for name in LOMO_UPDATE.names)
    return lambda: kernel(*args)


def run(
    device_name: str, numel: int, dtype: str, backend: str, reps: int, calls: int
) -> dict[str, float]:
    """Seconds per call of each way (module docstring): the fastest repetition's average."""
    device = torch.device(device_name)
    param = torch.randn(numel, dtype=DTYPES[dtype], device=device)
    grad = torch.randn_like(param)
    lr = torch.full((1,), 1e-3, device=device)
    flag = torch.zeros(1, device=device)
    module = resolve(device, backend)

    def public(backend: object) -> Callable[[], None]:
        return lambda: fused_lomo_update_(
            param, grad, lr=lr, found_inf=flag, skip_if=flag, backend=backend
        )

    ways = {
        "public (name)": public(backend),
        "public (module)": public(module),
        "Lomo per tensor": per_tensor(Lomo, param.clone(), backend),
        "AdaLomo per tensor": per_tensor(AdaLomo, as_matrix(param.clone()), backend),
        "kernel alone": kernel_alone(module, param, grad, lr, flag),
        FLOOR: lambda: param.add_(grad, alpha=-1e-3),
    }

    def repeated(call: Callable[[], object]) -> Callable[[], None]:
        def calls_in_a_row() -> None:
            for _ in range(calls):
                call()

        return calls_in_a_row

    batches = {name: repeated(call) for name, call in ways.items()}
    with torch.no_grad():  # as inside backward: nothing records these calls
        best = time_interleaved(batches, reps, WallClock(device), warmup=0, statistic=min)
    return {name: seconds / calls for name, seconds in best.items()}


def format_lines(per_call: dict[str, float], meta: dict[str, object]) -> str:
    lines = [
        f"host time per call: {meta['numel']} {meta['dtype']} on {meta['device']}, backend "
        f"{meta['backend']}, 1 thread; min over {meta['reps']} x {meta['calls']} calls"
    ]
    for name, seconds in per_call.items():
        ratio = seconds / per_call[FLOOR]
        lines.append(f"  {name:18s} {seconds * 1e6:7.2f} us  {ratio:5.2f}x {FLOOR}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_device_argument(parser)
    add_counts(parser, numel=4096, reps=40, calls=200)
    parser.add_argument("--dtype", default="bf16", choices=tuple(DTYPES))
    parser.add_argument("--backend", default="cpp", choices=BACKEND_NAMES)
    add_json_argument(parser)


def command(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    per_call = run(args.device, args.numel, args.dtype, args.backend, args.reps, args.calls)
    meta = machine.describe(args.device) | {
        key: getattr(args, key) for key in ("numel", "dtype", "backend", "reps", "calls")
    }
    machine.print_results(meta, format_lines(per_call, meta), args.json, seconds_per_call=per_call)
    return 0


if __name__ == "__main__":
    from bench.common.cli import main

    sys.exit(main(__spec__.name))
