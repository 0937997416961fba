"""The C++ CPU update and sum of squares at every vector level this CPU runs, against floors.

One build holds every level (csrc/cpu_isa.h: baseline, avx2, avx512, avx512bf16); this times
the binding `lomo_update_` with the full LOMO option set (the `bench kernels` values: unscale
by a device-tensor loss scale, clip by value, a clip_coef tensor, weight decay, inf/nan flag)
at each level the CPU has, `torch._fused_sgd_` (plain SGD) and the floor `p.add_(g,
alpha=-lr)` (the same bytes moved), one thread, interleaved, an untimed pass over the data
before each call, medians. Cells: median / median(axpy) of the same size and dtype. For
bf16 and fp16 the update with stochastic rounding (`sr[<level>]`, a seed and a per-step seed
tensor) is timed too; "sr/nearest" lines give its median over that of the round-to-nearest
update at the same level.

The gradient's sum of squares (`grad_sumsq_`, the norm pass of clipping by global norm:
squares in double, inf/nan flag) is timed the same way at each level against torch's
`torch.linalg.vector_norm(g, dtype=float32)`, what `clip_grad_norm_` runs (one read of the
gradient, fp32 accumulation): "sumsq" lines, cells median / median(vector_norm).

Time is the calling thread's CPU time (CLOCK_THREAD_CPUTIME_ID), not wall time: on a machine
shared with other jobs a call preempted mid-way would otherwise count the other jobs' time.
Memory stalls are CPU time, so memory-bound kernels are measured fully. CPU figures only.

Run: python bench/cpu_levels.py [--sizes 4M,16M] [--reps 41]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from lomo_kernels.kernels.cpp import lomo as cpp
from lomo_kernels.tools import machine
from lomo_kernels.tools.bench_kernels import (
    CLIP_COEF,
    CLIP_VALUE,
    DTYPES,
    INV_SCALE,
    LR,
    WEIGHT_DECAY,
    parse_sizes,
    size_label,
)

INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32}
SR_DTYPES = (torch.bfloat16, torch.float16)  # the parameters stochastic rounding applies to


def cpu_time(fn: Callable[[], None]) -> float:
    start = time.thread_time_ns()
    fn()
    return (time.thread_time_ns() - start) * 1e-9


def variants(p: torch.Tensor, g: torch.Tensor, levels: list[str]) -> dict[str, Callable]:
    """ours[<level>] per level (the caller sets the level), for bf16 and fp16 also sr[<level>]
    (stochastic rounding, with a per-step seed tensor), torch._fused_sgd_, axpy."""
    ext = cpp._loader.module("cpu")
    lr, inv_scale = torch.tensor([LR]), torch.tensor([INV_SCALE])
    coef, found = torch.tensor([CLIP_COEF]), torch.zeros(1)
    seed_step = torch.tensor([3], dtype=torch.int64)

    def ours() -> None:
        ext.lomo_update_(
            p, g, lr, inv_scale, CLIP_VALUE, coef, WEIGHT_DECAY, found, None, False, 0, None
        )

    def sr() -> None:
        ext.lomo_update_(
            p, g, lr, inv_scale, CLIP_VALUE, coef, WEIGHT_DECAY, found, None, True, 7, seed_step
        )

    # An extension without levels (an older build): its one loop set, as "ours".
    out = {f"ours[{level}]": ours for level in levels} if levels else {"ours": ours}
    if p.dtype in SR_DTYPES:
        out.update({f"sr[{level}]": sr for level in levels} if levels else {"sr": sr})
    out["torch._fused_sgd_"] = lambda: torch._fused_sgd_(
        [p], [g], [], weight_decay=0.0, momentum=0.0, lr=LR, dampening=0.0,
        nesterov=False, maximize=False, is_first_step=False,
    )  # fmt: skip
    out["axpy"] = lambda: p.add_(g, alpha=-LR)
    return out


def sumsq_variants(g: torch.Tensor, levels: list[str]) -> dict[str, Callable]:
    """sumsq[<level>] per level (the caller sets the level) and vector_norm."""
    ext = cpp._loader.module("cpu")
    inv_scale, sumsq, found = torch.tensor([INV_SCALE]), torch.zeros(1), torch.zeros(1)

    def ours() -> None:
        ext.grad_sumsq_(g, inv_scale, sumsq, found)

    out = {f"sumsq[{level}]": ours for level in levels} if levels else {"sumsq": ours}
    out["vector_norm"] = lambda: torch.linalg.vector_norm(g, dtype=torch.float32)
    return out


def time_interleaved(
    fns: dict[str, Callable], tensors: tuple[torch.Tensor, ...], reps: int, ext
) -> dict[str, float]:
    """Median thread CPU time of each function, interleaved, the same cache state before
    every call; a key "<name>[<level>]" runs at that level, set outside the timing (what
    `bench_kernels.time_interleaved`, wall clock and no per-call level, does not do)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for key, fn in fns.items():
            if key.endswith("]"):  # <name>[<level>]: set outside the timing
                ext._set_cpu_isa(key[key.index("[") + 1 : -1])
            for t in tensors:
                t.view(INT_VIEW[t.element_size()]).max()
            times[key].append(cpu_time(fn))
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=parse_sizes, default=parse_sizes("64K,1M,4M,16M"))
    parser.add_argument("--dtype", default=",".join(DTYPES), help="comma list of bf16,fp16,fp32")
    parser.add_argument("--reps", type=int, default=41)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ext = cpp._loader.module("cpu")
    levels = ext._cpu_isas() if hasattr(ext, "_cpu_isas") else []
    previous = ext._cpu_isa() if levels else None
    print(
        f"CPU {machine.cpu_model()} ({machine.vector_isa()}), 1 thread, torch {torch.__version__}"
    )
    print(
        "cells: median thread CPU time / that of axpy (p.add_); sumsq lines: / that of "
        "vector_norm; same size and dtype"
    )
    try:
        for name in args.dtype.split(","):
            for numel in args.sizes:
                gen = torch.Generator().manual_seed(numel)
                p = torch.randn(numel, generator=gen).to(DTYPES[name])
                g = (torch.randn(numel, generator=gen) * 1e-2).to(DTYPES[name])
                med = time_interleaved(variants(p, g, levels), (p, g), args.reps, ext)
                cells = "  ".join(
                    f"{k} {v / med['axpy']:.3f}" for k, v in med.items() if k != "axpy"
                )
                gbps = 3 * numel * p.element_size() / med["axpy"] / 1e9
                print(f"{name} {size_label(numel):>4}: {cells}  (axpy {gbps:.1f} GB/s)")
                ratios = [
                    f"{key[2:]} {v / med['ours' + key[2:]]:.3f}"
                    for key, v in med.items()
                    if key.startswith("sr")
                ]
                if ratios:
                    print(f"{name} {size_label(numel):>4} sr/nearest: {'  '.join(ratios)}")
                med = time_interleaved(sumsq_variants(g, levels), (g,), args.reps, ext)
                floor = med["vector_norm"]
                cells = "  ".join(
                    f"{k} {v / floor:.3f}" for k, v in med.items() if k != "vector_norm"
                )
                gbps = numel * g.element_size() / floor / 1e9
                print(
                    f"{name} {size_label(numel):>4} sumsq: {cells}  (vector_norm {gbps:.1f} GB/s)"
                )
    finally:
        if previous is not None:
            ext._set_cpu_isa(previous)


if __name__ == "__main__":
    main()
