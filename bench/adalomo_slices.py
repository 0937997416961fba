"""`python -m bench.adalomo_slices`: one rank's AdaLomo step on its slice of a sharded matrix
(ZeRO-3, FSDP2), per backend.

    python -m bench.adalomo_slices [--device cpu|cuda] [--size 4096] [--ranks 8]
                                   [--dtype bf16] [--reps 15] [--threads 1] [--json F]

A [size, size] matrix cut into `ranks` flat slices; the benchmarked slice is the middle
rank's, shifted by 123 elements so that it starts mid-row, as a reduce-scatter cuts it.
`optim.adalomo_slices_` steps it with stochastic rounding (bf16, fp16), the all-reduce the
identity (one process stands for every rank: the all-reduces' cost is the sharding's, not
measured here). Per backend B, `slice[B]`: its fused passes (pass A, the norm and the
write-back on the slice at its offset, the moments pass on the summed sums); on the torch
backend each pass runs as torch ops per tile of at most 64K elements, the form the sharded
step took before the passes took a slice. Each cell: the median, and the torch ops one step
dispatches (a fused pass counts once whatever the backend runs inside it). For scale,
`whole`: the fastest backend's unsharded `adalomo_update_` of the whole matrix (`ranks` times
the elements).

Method: `bench.kernels`' (one process, variants interleaved within each repetition, the same
cache state before every call; on CUDA device time behind a spin kernel; medians). CPU
figures are CPU figures: never read them as GPU timings.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lomo_kernels import ops
from lomo_kernels.distributed.shard import Shard
from lomo_kernels.ops.adalomo import adalomo_step_arguments
from lomo_kernels.ops.backends import ADALOMO
from lomo_kernels.optim.adalomo_slices import SliceStep, adalomo_slices_, init_slice_state

from .common import machine
from .common.argtypes import add_counts, add_device_argument, add_json_argument
from .common.dtypes import DTYPES
from .common.timing import DeviceClock, time_interleaved
from .kernels import available_backends

SHIFT = 123  # the benchmarked slice: the middle rank's, moved to start mid-row
LR, BETA2, SEED = 1e-5, 0.5, 7


class _CountOps(TorchDispatchMode):
    """The torch ops dispatched at this level (a fused pass: one)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def variants(
    param: torch.Tensor, grad: torch.Tensor, ranks: int, backends: list[str]
) -> dict[str, Callable[[], None]]:
    """slice[B] per backend B (one rank's sliced step), then whole (the whole matrix, on the
    first backend: the fastest)."""
    device = param.device
    n = param.numel() // ranks
    offset = (ranks // 2) * n + SHIFT
    shard = Shard(param=param, local=param.view(-1)[offset : offset + n], offset=offset,
                  full_shape=param.shape, group=None)  # fmt: skip
    slice_grad = grad.view(-1)[offset : offset + n]
    seed_step = torch.tensor([3], dtype=torch.int64, device=device)
    stochastic = param.dtype != torch.float32
    arguments = adalomo_step_arguments(
        device, True, lr=LR, beta2=BETA2, eps=(1e-30, 1e-3), clip_threshold=1.0,
        weight_decay=0.0, inv_scale=None, clip_value=None, clip_coef=None, found_inf=None,
        skip_if=None, stochastic_rounding=stochastic, seed=SEED,
        seed_step=seed_step if stochastic else None,
    )  # fmt: skip
    flags = torch.zeros(1, device=device), torch.zeros(1, device=device)
    state = init_slice_state(shard)

    def sliced(backend: str) -> Callable[[], None]:
        module = ADALOMO.resolve(device, backend)
        step = SliceStep(shard=shard, grad=slice_grad, state=state, arguments=arguments,
                         backend=module)  # fmt: skip
        return lambda: adalomo_slices_([step], *flags, lambda t: None)

    def whole(backend: str) -> Callable[[], None]:
        whole_state: dict[str, torch.Tensor] = {}
        return lambda: ops.adalomo_update_(
            param, grad, whole_state, lr=LR, beta2=BETA2, stochastic_rounding=stochastic,
            seed=SEED, seed_step=seed_step if stochastic else None, backend=backend,
        )  # fmt: skip

    out = {f"slice[{b}]": sliced(b) for b in backends}
    out["whole"] = whole(backends[0])
    return out


def ops_per_call(fn: Callable[[], None]) -> int:
    with _CountOps() as counter:
        fn()
    return counter.count


def run(device: str, dtype: str, size: int, ranks: int, reps: int) -> dict[str, Any]:
    """Each variant's median (seconds) and torch ops per call, by name."""
    gen = torch.Generator().manual_seed(size)
    param = (torch.randn(size, size, generator=gen) * 0.02).to(device, DTYPES[dtype])
    grad = (torch.randn(size, size, generator=gen) * 1e-3).to(device, DTYPES[dtype])
    fns = variants(param, grad, ranks, available_backends(device))
    clock = DeviceClock(device)
    medians = time_interleaved(fns, reps, clock, settle=lambda _n: clock.settle((param, grad)))
    counts = {name: ops_per_call(fn) for name, fn in fns.items()}
    return {"dtype": dtype, "size": size, "ranks": ranks, "slice_numel": param.numel() // ranks,
            "seconds": medians, "torch_ops": counts}  # fmt: skip


def format_lines(result: dict[str, Any]) -> str:
    """One line per variant: median ms, its ratio to the fastest slice, torch ops per step."""
    med, counts = result["seconds"], result["torch_ops"]
    fastest = min(v for k, v in med.items() if k.startswith("slice["))
    lines = [
        f"{result['dtype']} [{result['size']}, {result['size']}] at 1/{result['ranks']}: "
        f"a slice of {result['slice_numel']:,} elements cut mid-row"
    ]
    for name, seconds in med.items():
        lines.append(f"  {name:<14} {seconds * 1e3:9.2f} ms  {seconds / fastest:6.2f}x  "
                     f"{counts[name]:>6} torch ops")  # fmt: skip
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_device_argument(parser)
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    add_counts(parser, size=4096, ranks=8, reps=15, threads=1)
    add_json_argument(parser)


def _checked(args: argparse.Namespace) -> argparse.Namespace:
    if args.ranks < 2 or args.size * args.size // args.ranks <= SHIFT:
        raise SystemExit(
            f"--ranks {args.ranks} --size {args.size}: need at least 2 ranks and slices of "
            f"more than {SHIFT} elements"
        )
    return args


def command(args: argparse.Namespace) -> int:
    args = _checked(args)
    torch.set_num_threads(args.threads)
    result = run(args.device, args.dtype, args.size, args.ranks, args.reps)
    meta = machine.describe(args.device)
    machine.print_results(meta, format_lines(result), args.json, results=result)
    return 0


if __name__ == "__main__":
    from bench.common.cli import main

    sys.exit(main(__spec__.name))
