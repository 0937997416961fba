"""`python -m bench.cpu_levels`: the C++ CPU update and sum of squares at every vector
level this CPU runs, against floors.

    python -m bench.cpu_levels [--sizes 64K,1M,4M,16M] [--dtype bf16,fp16,fp32,int8]
                                  [--reps 41] [--json F]

One build holds every level (csrc/cpu_isa.h: baseline, avx2, avx512, avx512bf16); this times
the binding `lomo_update_` with the full LOMO option set (the `bench.kernels` values: unscale
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

Gradient accumulation's pass (`grad_accumulate_`: the buffer += the gradient, rounded into
the buffer's dtype, with the stored values' inf/nan flag: what each micro-batch of
`accumulation_steps` runs but the measuring one) is timed at each level, to nearest
(`acc[<level>]`) and for bf16 and fp16 stochastically (`acc_sr[<level>]`), and as
`acc+sumsq` / `acc_sr+sumsq` with the stored values' sum of squares too (the measuring
micro-batch of clipping by norm), against the floor `b.add_(g)` (the same bytes):
"accumulate" lines, cells median / median(add_), and "accumulate sr/nearest" lines.

The 8-bit blockwise buffer's accumulation pass (`--dtype int8`: `grad_accumulate_int8_` of a
bf16 gradient with stochastic rounding and the inf/nan flag, `int8[<level>]`;
`int8+sumsq[<level>]` also measures the sum of squares, as a step's measuring micro-batch
does) is timed at each level against the bf16 buffer's stochastic pass of the same gradient
(`bf16_sr[<level>]`, `bf16_sr+sumsq[<level>]`) and the floor `b.add_(g)` of the bf16 buffer:
"int8 ... accumulate" lines, cells median / median(add_), and "accumulate int8/bf16_sr"
lines, the int8 pass's median over the bf16 one's at the same level.

Time is the calling thread's CPU time (CLOCK_THREAD_CPUTIME_ID), not wall time: on a machine
shared with other jobs a call preempted mid-way would otherwise count the other jobs' time.
Memory stalls are CPU time, so memory-bound kernels are measured fully. CPU figures only.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import torch

from lomo_kernels.core.int8_blocks import blocks_of
from lomo_kernels.core.rounding import rounds_stochastically
from lomo_kernels.ops.lomo import cpp_backend as cpp

from .common import machine
from .common.argtypes import (
    add_counts,
    add_json_argument,
    add_list_argument,
)
from .common.dtypes import DTYPES
from .common.timing import ThreadClock, read_once, time_interleaved
from .kernels import (
    CLIP_COEF,
    CLIP_VALUE,
    INV_SCALE,
    LR,
    WEIGHT_DECAY,
    add_sizes_argument,
    fused_sgd,
    size_label,
)

SIZES = (2**16, 2**20, 2**22, 2**24)  # 64K, 1M, 4M, 16M
INT8 = "int8"  # the 8-bit blockwise buffer's rows (`int8_rows`)


def variants(p: torch.Tensor, g: torch.Tensor, levels: list[str]) -> dict[str, Callable]:
    """ours[<level>] per level (the caller sets the level), for bf16 and fp16 also sr[<level>]
    (stochastic rounding, with a per-step seed tensor), torch._fused_sgd_, axpy."""
    ext = cpp._loader.module("cpu")
    lr, inv_scale = torch.tensor([LR]), torch.tensor([INV_SCALE])
    coef, found = torch.tensor([CLIP_COEF]), torch.zeros(1)
    seed_step = torch.tensor([3], dtype=torch.int64)

    def ours() -> None:
        ext.lomo_update_(
            p, g, lr, inv_scale, CLIP_VALUE, coef, WEIGHT_DECAY, found, None, False, 0, None, 0
        )

    def sr() -> None:
        ext.lomo_update_(
            p,
            g,
            lr,
            inv_scale,
            CLIP_VALUE,
            coef,
            WEIGHT_DECAY,
            found,
            None,
            True,
            7,
            seed_step,
            0,
        )

    # An extension without levels (an older build): its one loop set, as "ours".
    out = {f"ours[{level}]": ours for level in levels} if levels else {"ours": ours}
    if rounds_stochastically(p.dtype):
        out.update({f"sr[{level}]": sr for level in levels} if levels else {"sr": sr})
    out["torch._fused_sgd_"] = lambda: fused_sgd([p], [g], LR)
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


def accumulate_variants(b: torch.Tensor, g: torch.Tensor, levels: list[str]) -> dict[str, Callable]:
    """acc[<level>] and, for bf16 and fp16, acc_sr[<level>] per level (the caller sets the
    level): the inf/nan flag alone, as the micro-batches before a step's measuring one run it
    (every micro-batch without clipping by norm); as "<name>+sumsq" the sum of squares too,
    as the measuring micro-batch runs it; add_."""
    ext = cpp._loader.module("cpu")
    inv_scale, sumsq, found = torch.tensor([INV_SCALE]), torch.zeros(1), torch.zeros(1)
    seed_step = torch.tensor([3], dtype=torch.int64)

    def make(stochastic: bool, measured: torch.Tensor | None) -> Callable[[], None]:
        seed, step = (7, seed_step) if stochastic else (0, None)
        return lambda: ext.grad_accumulate_(
            b, g, False, inv_scale, measured, found, stochastic, seed, step, 0
        )

    names = [("acc", False)] + ([("acc_sr", True)] if rounds_stochastically(b.dtype) else [])
    out = {}
    for name, stochastic in names:
        for suffix, measured in (("", None), ("+sumsq", sumsq)):
            fn = make(stochastic, measured)
            keys = [f"{name}{suffix}[{level}]" for level in levels] or [f"{name}{suffix}"]
            out.update(dict.fromkeys(keys, fn))
    out["add_"] = lambda: b.add_(g)
    return out


def int8_variants(
    g: torch.Tensor, levels: list[str]
) -> tuple[dict[str, Callable], tuple[torch.Tensor, ...]]:
    """int8[<level>] (the 8-bit buffer's pass) and bf16_sr[<level>] (a bf16 buffer's) per level
    (the caller sets the level), both adding the bf16 gradient `g` stochastically: with the
    inf/nan flag alone (the passes before a step's measuring one) and, as "<name>+sumsq", with
    the sum of squares too (the measuring one); add_ into the bf16 buffer. Also the tensors
    they touch."""
    ext = cpp._loader.module("cpu")
    numel = g.numel()
    codes = torch.zeros(numel, dtype=torch.int8)
    scales = torch.zeros(blocks_of(0, numel))
    buffer = torch.zeros_like(g)
    inv_scale, sumsq, found = torch.tensor([INV_SCALE]), torch.zeros(1), torch.zeros(1)
    seed_step = torch.tensor([3], dtype=torch.int64)

    def int8(measured: bool) -> Callable[[], None]:
        out = sumsq if measured else None
        return lambda: ext.grad_accumulate_int8_(
            codes, scales, g, 0, False, inv_scale, out, found, True, 7, seed_step
        )

    def bf16_sr(measured: bool) -> Callable[[], None]:
        out = sumsq if measured else None
        return lambda: ext.grad_accumulate_(
            buffer, g, False, inv_scale, out, found, True, 7, seed_step, 0
        )

    out = {}
    for name, make in (("int8", int8), ("bf16_sr", bf16_sr)):
        for suffix, measured in (("", False), ("+sumsq", True)):
            out.update({f"{name}{suffix}[{level}]": make(measured) for level in levels})
    out["add_"] = lambda: buffer.add_(g)
    return out, (codes, scales, buffer, g)


def at_levels(
    fns: dict[str, Callable], tensors: tuple[torch.Tensor, ...], reps: int, ext: Any
) -> dict[str, float]:
    """Median thread CPU time of each function, interleaved, the same cache state before
    every call; a key "<name>[<level>]" runs at that level, set outside the timing."""

    def settle(key: str) -> None:
        if key.endswith("]"):  # <name>[<level>]
            level = key[key.index("[") + 1 : -1]
            ext._set_cpu_isa(level)
            running = ext._loops_level()  # as the loops' own copy says
            if running != level:  # the figure would be another level's
                raise RuntimeError(f"asked for the {level} CPU loops, but {running} run")
        read_once(tensors)

    return time_interleaved(fns, reps, ThreadClock(), settle, warmup=0)


def run(dtypes: list[str], sizes: list[int], reps: int) -> list[dict[str, Any]]:
    """Per dtype and size: the update's and the sum of squares' medians (seconds) by key."""
    ext = cpp._loader.module("cpu")
    levels = ext._cpu_isas() if hasattr(ext, "_cpu_isas") else []
    previous = ext._cpu_isa() if levels else None
    results = []
    try:
        for name in dtypes:
            for numel in sizes:
                if name == INT8:
                    results.append(int8_rows(numel, levels, reps, ext))
                    continue
                gen = torch.Generator().manual_seed(numel)
                p = torch.randn(numel, generator=gen).to(DTYPES[name])
                g = (torch.randn(numel, generator=gen) * 1e-2).to(DTYPES[name])
                update = at_levels(variants(p, g, levels), (p, g), reps, ext)
                sumsq = at_levels(sumsq_variants(g, levels), (g,), reps, ext)
                buffer = torch.zeros_like(p)
                accumulate = at_levels(
                    accumulate_variants(buffer, g, levels), (buffer, g), reps, ext
                )
                item = {"dtype": name, "numel": numel, "element_size": p.element_size()}
                results.append(
                    item | {"update_s": update, "sumsq_s": sumsq, "accumulate_s": accumulate}
                )
    finally:
        if previous is not None:
            ext._set_cpu_isa(previous)
    return results


def int8_rows(numel: int, levels: list[str], reps: int, ext: Any) -> dict[str, Any]:
    """The 8-bit buffer's accumulation medians (seconds) by key at one size."""
    gen = torch.Generator().manual_seed(numel)
    g = (torch.randn(numel, generator=gen) * 1e-2).to(torch.bfloat16)
    fns, tensors = int8_variants(g, levels)
    accumulate = at_levels(fns, tensors, reps, ext)
    return {"dtype": INT8, "numel": numel, "element_size": g.element_size(),
            "accumulate_s": accumulate}  # fmt: skip


def _timed_lines(
    where: str,
    med: dict[str, float],
    floor: str,
    passes: int,
    numel_bytes: int,
    label: str = "",
    variants: tuple[str, str] | None = None,
    ratio: str = "sr/nearest",
) -> list[str]:
    """One kernel's lines at one dtype and size: its cells (median / that of `floor`, which
    moves `passes` x `numel_bytes` bytes), then, with `variants` (the keys' prefixes of the
    base and the compared kernel: round-to-nearest and stochastic by default), the compared
    one's median over the base one's per level where it was timed, on a line named `ratio`."""
    cells = "  ".join(f"{k} {v / med[floor]:.3f}" for k, v in med.items() if k != floor)
    gbps = passes * numel_bytes / med[floor] / 1e9
    lines = [f"{where}{label}: {cells}  ({floor} {gbps:.1f} GB/s)"]
    if variants is None:
        return lines
    nearest, stochastic = variants
    level = len(stochastic)
    ratios = [
        f"{key[level:]} {v / med[nearest + key[level:]]:.3f}"
        for key, v in med.items()
        if key.startswith(stochastic)
    ]
    if ratios:
        lines.append(f"{where}{label} {ratio}: {'  '.join(ratios)}")
    return lines


def format_lines(results: list[dict[str, Any]]) -> str:
    """Per dtype and size: the update line (/ axpy), the sr/nearest line, the sumsq line, the
    accumulate line (/ add_) and its sr/nearest line."""
    lines = [
        "cells: median thread CPU time / that of axpy (p.add_); sumsq lines: / that of "
        "vector_norm; accumulate lines: / that of add_ (b.add_(g)); same size and dtype"
    ]
    for r in results:
        where = f"{r['dtype']} {size_label(r['numel']):>4}"
        numel_bytes = r["numel"] * r["element_size"]
        if r["dtype"] == INT8:  # the bf16 gradient's bytes: add_ into the bf16 buffer
            lines += _timed_lines(where, r["accumulate_s"], "add_", 3, numel_bytes,
                                  " accumulate", ("bf16_sr", "int8"), "int8/bf16_sr")  # fmt: skip
            continue
        lines += _timed_lines(where, r["update_s"], "axpy", 3, numel_bytes, "", ("ours", "sr"))
        lines += _timed_lines(where, r["sumsq_s"], "vector_norm", 1, numel_bytes, " sumsq")
        if r.get("accumulate_s"):
            accumulate, variants = r["accumulate_s"], ("acc", "acc_sr")
            lines += _timed_lines(
                where, accumulate, "add_", 3, numel_bytes, " accumulate", variants
            )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_sizes_argument(parser, SIZES)
    add_list_argument(parser, "--dtype", [*DTYPES, INT8])
    add_counts(parser, reps=41)
    add_json_argument(parser)


def command(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    results = run(args.dtype, args.sizes, args.reps)
    meta = machine.describe("cpu")
    machine.print_results(meta, format_lines(results), args.json, results=results)
    return 0


if __name__ == "__main__":
    from bench.common.cli import main

    sys.exit(main(__spec__.name))
