"""`python -m bench.adalomo_slices`: one rank's AdaLomo step on its slice of a sharded matrix
(ZeRO-3, FSDP2), per backend.

    python -m bench.adalomo_slices [--device cpu|cuda] [--size 4096] [--ranks 8]
                                   [--slices 1] [--dtype bf16] [--reps 15] [--threads 1]
                                   [--json F]

A [size, size] matrix cut into `ranks` flat slices; the benchmarked slice is the middle
rank's, shifted by 123 elements so that it starts mid-row, as a reduce-scatter cuts it.
`--slices N`: a bucket of N such slices, each of its own matrix, stepped together.
`optim.adalomo_slices_` steps it with stochastic rounding (bf16, fp16), the all-reduce the
identity (one process stands for every rank: the all-reduces' cost is the sharding's, not
measured here). Per backend B, `slice[B]`: its fused passes (pass A, the norm and the
write-back on the slice at its offset, the moments pass on the summed sums); on the torch
backend each pass runs as torch ops per tile of at most 64K elements, the form the sharded
step took before the passes took a slice. Each cell: the median, and the torch ops one step
dispatches (a fused pass counts once whatever the backend runs inside it), and how many of
them launch work (are not views of a tensor: on a GPU, a kernel launch each). For scale,
`whole`: the fastest backend's unsharded `adalomo_update_` of one whole matrix (`ranks` times
a slice's elements).

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


# Ops that only view a tensor, or split it into views: they launch nothing.
VIEWS = frozenset(
    "aten." + name
    for name in ("view.default", "slice.Tensor", "select.int", "alias.default",
                 "_reshape_alias.default", "as_strided.default", "split.Tensor",
                 "split_with_sizes.default", "unbind.int")
)  # fmt: skip


class _CountOps(TorchDispatchMode):
    """The torch ops dispatched at this level (a fused pass: one), and those not views."""

    def __init__(self) -> None:
        super().__init__()
        self.count = self.launching = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        self.launching += str(func) not in VIEWS
        return func(*args, **(kwargs or {}))


def variants(
    params: list[torch.Tensor], grads: list[torch.Tensor], ranks: int, backends: list[str]
) -> dict[str, Callable[[], None]]:
    """slice[B] per backend B (one rank's sliced step of a bucket of one slice per matrix),
    then whole (the first matrix whole, on the first backend: the fastest)."""
    param, grad = params[0], grads[0]
    device = param.device
    n = param.numel() // ranks
    offset = (ranks // 2) * n + SHIFT
    shards = [
        Shard(param=p, local=p.view(-1)[offset : offset + n], offset=offset,
              full_shape=p.shape, group=None)
        for p in params
    ]  # fmt: skip
    slice_grads = [g.view(-1)[offset : offset + n] for g in grads]
    seed_step = torch.tensor([3], dtype=torch.int64, device=device)
    stochastic = param.dtype != torch.float32
    arguments = adalomo_step_arguments(
        device, True, lr=LR, beta2=BETA2, eps=(1e-30, 1e-3), clip_threshold=1.0,
        weight_decay=0.0, inv_scale=None, clip_value=None, clip_coef=None, found_inf=None,
        skip_if=None, stochastic_rounding=stochastic, seed=SEED,
        seed_step=seed_step if stochastic else None,
    )  # fmt: skip
    flags = torch.zeros(1, device=device), torch.zeros(1, device=device)
    states = [init_slice_state(shard) for shard in shards]

    def sliced(backend: str) -> Callable[[], None]:
        module = ADALOMO.resolve(device, backend)
        steps = [
            SliceStep(shard=shard, grad=g, state=state, arguments=arguments, backend=module)
            for shard, g, state in zip(shards, slice_grads, states, strict=True)
        ]
        return lambda: adalomo_slices_(steps, *flags, lambda t: None)

    def whole(backend: str) -> Callable[[], None]:
        whole_state: dict[str, torch.Tensor] = {}
        return lambda: ops.adalomo_update_(
            param, grad, whole_state, lr=LR, beta2=BETA2, stochastic_rounding=stochastic,
            seed=SEED, seed_step=seed_step if stochastic else None, backend=backend,
        )  # fmt: skip

    out = {f"slice[{b}]": sliced(b) for b in backends}
    out["whole"] = whole(backends[0])
    return out


def ops_per_call(fn: Callable[[], None]) -> tuple[int, int]:
    """(torch ops, of them launching) one call dispatches."""
    with _CountOps() as counter:
        fn()
    return counter.count, counter.launching


def run(device: str, dtype: str, size: int, ranks: int, slices: int, reps: int) -> dict[str, Any]:
    """Each variant's median (seconds) and torch ops per call, by name."""
    gen = torch.Generator().manual_seed(size)
    params, grads = [], []
    for _ in range(slices):
        params.append((torch.randn(size, size, generator=gen) * 0.02).to(device, DTYPES[dtype]))
        grads.append((torch.randn(size, size, generator=gen) * 1e-3).to(device, DTYPES[dtype]))
    fns = variants(params, grads, ranks, available_backends(device))
    clock = DeviceClock(device)
    tensors = (*params, *grads)
    medians = time_interleaved(fns, reps, clock, settle=lambda _n: clock.settle(tensors))
    counts = {name: ops_per_call(fn) for name, fn in fns.items()}
    return {"dtype": dtype, "size": size, "ranks": ranks, "slices": slices,
            "slice_numel": size * size // ranks, "seconds": medians,
            "torch_ops": {name: c[0] for name, c in counts.items()},
            "launching_ops": {name: c[1] for name, c in counts.items()}}  # fmt: skip


def format_lines(result: dict[str, Any]) -> str:
    """One line per variant: median ms, its ratio to the fastest slice, torch ops per step."""
    med, counts, launching = result["seconds"], result["torch_ops"], result["launching_ops"]
    fastest = min(v for k, v in med.items() if k.startswith("slice["))
    bucket = f"a bucket of {result['slices']} slices" if result["slices"] > 1 else "a slice"
    lines = [
        f"{result['dtype']} [{result['size']}, {result['size']}] at 1/{result['ranks']}: "
        f"{bucket} of {result['slice_numel']:,} elements cut mid-row"
    ]
    for name, seconds in med.items():
        lines.append(f"  {name:<14} {seconds * 1e3:9.2f} ms  {seconds / fastest:6.2f}x  "
                     f"{counts[name]:>6} torch ops, {launching[name]:>5} launching")  # fmt: skip
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_device_argument(parser)
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    add_counts(parser, size=4096, ranks=8, slices=1, reps=15, threads=1)
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
    result = run(args.device, args.dtype, args.size, args.ranks, args.slices, args.reps)
    meta = machine.describe(args.device)
    machine.print_results(meta, format_lines(result), args.json, results=result)
    return 0


if __name__ == "__main__":
    from bench.common.cli import main

    sys.exit(main(__spec__.name))
