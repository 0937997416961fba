"""`python -m bench.accumulate`: gradient accumulation's pass on every backend that serves the
device, to nearest and with stochastic rounding, against the floor `b.add_(g)`.

    python -m bench.accumulate [--device cpu|cuda] [--dtype bf16,fp16,fp32] [--sizes 16M,64M]
                               [--reps 21] [--json F]

`ops.grad_accumulate_` (the buffer += the gradient, rounded into the buffer's dtype, a buffer
and gradient of the same dtype) per backend B: `acc[B]` with the inf/nan flag alone, what
every micro-batch of `accumulation_steps` runs but the measuring one, and `acc[B]+sumsq` with
the stored values' sum of squares too, the measuring one's; for bf16 and fp16 also `acc_sr`
(stochastic rounding, a per-step seed tensor, as the optimizers' default). Each cell: median
/ median(`add_`, the same bytes moved: read buffer and gradient, write buffer), with GB/s;
the "sr/nearest" line gives each stochastic pass's median over the round-to-nearest one's of
the same backend and form: the target is at most 1.05x on a GPU (the pass is bound by memory
there) and 1.3x on a CPU.

Method: `bench.kernels`' (one process, variants interleaved within each repetition, the same
cache state before every call: on CUDA the L2 flushed and device time measured behind a spin
kernel, on the CPU the data read once; medians). The CPU's loops at every vector level, on
one thread's CPU time: `bench.cpu_levels`. CPU figures are CPU figures: never read them as
GPU timings.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import torch

from lomo_kernels import ops
from lomo_kernels.core.rounding import rounds_stochastically

from .common import machine
from .common.argtypes import add_counts, add_device_argument, add_json_argument, add_list_argument
from .common.dtypes import DTYPES
from .common.timing import DeviceClock, time_interleaved
from .kernels import (
    CPU_REFERENCE_MAX_NUMEL,
    INV_SCALE,
    add_sizes_argument,
    available_backends,
    size_label,
)

SIZES = (2**24, 2**26)  # 16M, 64M: a 7B model's matrices are 16-50M elements
FLOOR = "add_"


def variants(
    buffer: torch.Tensor, grad: torch.Tensor, backends: list[str]
) -> dict[str, Callable[[], None]]:
    """acc[B] and acc[B]+sumsq per backend B, for bf16 and fp16 also acc_sr[B] and
    acc_sr[B]+sumsq; add_."""
    device = buffer.device
    inv_scale = torch.tensor([INV_SCALE], device=device)
    sumsq, found = torch.zeros(1, device=device), torch.zeros(1, device=device)
    seed_step = torch.tensor([3], dtype=torch.int64, device=device)
    stochastic_forms = (False, True) if rounds_stochastically(buffer.dtype) else (False,)

    def make(backend: str, stochastic: bool, measured: torch.Tensor | None) -> Callable:
        return lambda: ops.grad_accumulate_(
            buffer, grad, inv_scale=inv_scale, sumsq=measured, found_inf=found,
            stochastic_rounding=stochastic, seed=7, seed_step=seed_step if stochastic else None,
            backend=backend,
        )  # fmt: skip

    out: dict[str, Callable[[], None]] = {}
    for backend in backends:
        if backend == "torch" and device.type == "cpu" and buffer.numel() > CPU_REFERENCE_MAX_NUMEL:
            continue
        for stochastic in stochastic_forms:
            name = "acc_sr" if stochastic else "acc"
            for suffix, measured in (("", None), ("+sumsq", sumsq)):
                out[f"{name}[{backend}]{suffix}"] = make(backend, stochastic, measured)
    out[FLOOR] = lambda: buffer.add_(grad)
    return out


def run(device: str, dtypes: list[str], sizes: list[int], reps: int) -> list[dict[str, Any]]:
    """Per dtype and size: each variant's median (seconds) by name."""
    clock = DeviceClock(device)
    backends = available_backends(device)
    results = []
    for name in dtypes:
        for numel in sizes:
            gen = torch.Generator().manual_seed(numel)
            grad = (torch.randn(numel, generator=gen) * 1e-2).to(device, DTYPES[name])
            buffer = torch.zeros_like(grad)
            fns = variants(buffer, grad, backends)
            settle = lambda _name, tensors=(buffer, grad): clock.settle(tensors)
            medians = time_interleaved(fns, reps, clock, settle=settle)
            results.append({"dtype": name, "numel": numel, "element_size": grad.element_size(),
                            "seconds": medians})  # fmt: skip
            del buffer, grad, fns
    return results


def format_lines(results: list[dict[str, Any]]) -> str:
    """Per dtype and size: the cells line (x add_, GB/s of add_) and, where timed, the
    sr/nearest line."""
    lines = ["cells: median / that of add_ (b.add_(g): the same bytes), same size and dtype"]
    for r in results:
        where = f"{r['dtype']} {size_label(r['numel']):>4}"
        med = r["seconds"]
        floor = med[FLOOR]
        gbps = 3 * r["numel"] * r["element_size"] / floor / 1e9
        cells = "  ".join(f"{k} {v / floor:.3f}" for k, v in med.items() if k != FLOOR)
        lines.append(f"{where}: {cells}  ({FLOOR} {gbps:.1f} GB/s)")
        ratios = [
            f"{key[len('acc_sr') :]} {v / med['acc' + key[len('acc_sr') :]]:.3f}"
            for key, v in med.items()
            if key.startswith("acc_sr")
        ]
        if ratios:
            lines.append(f"{where} sr/nearest: {'  '.join(ratios)}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_device_argument(parser)
    add_list_argument(parser, "--dtype", list(DTYPES), default="bf16,fp16")
    add_sizes_argument(parser, SIZES)
    add_counts(parser, reps=21, threads=1)
    add_json_argument(parser)


def command(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    results = run(args.device, args.dtype, args.sizes, args.reps)
    meta = machine.describe(args.device)
    machine.print_results(meta, format_lines(results), args.json, results=results)
    return 0


if __name__ == "__main__":
    from bench.common.cli import main

    sys.exit(main(__spec__.name))
