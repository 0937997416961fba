"""Peak host memory of one training step on CPU, per optimizer (method: MEASURING.md).

The measurement lives in lomo_kernels/tools/bench_memory.py (`lomo-kernels bench memory`);
this script prints the table of every configuration at two batch shapes.

    python bench/memory.py CONFIG --batch B --seq S [--steps N] [--json]
    python bench/memory.py --all [--batch B --seq S] [--json-out PATH]

One configuration per process: glibc only returns freed memory to the system when large
blocks are mmapped, so MALLOC_MMAP_THRESHOLD_=65536 must be in the environment before the
process starts (the script re-executes itself with it). The baseline is VmRSS once the bf16
model, the inputs and the optimizer exist; before each step "5" is written to
/proc/self/clear_refs (resets VmHWM) and VmHWM is read after it. Step 0 is skipped (lazy
state, first-call allocations); the figure is the max over steps 1..N-1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lomo_kernels.tools.bench_memory import (  # noqa: E402
    CONFIGS,
    LABELS,
    MMAP_ENV,
    MMAP_VALUE,
    run_isolated,
)
from lomo_kernels.tools.machine import cpu_model  # noqa: E402

MB = 2**20  # MiB, the unit of the figures in MEASURING.md
DEFAULT_SHAPES = ((1, 64), (2, 256))


def machine_line(results: Sequence[dict[str, Any]]) -> str:
    first = next(iter(results), {})
    cpu = cpu_model()
    backends = sorted({r["backend"] for r in results if "backend" in r})
    return (
        f"CPU: {cpu}, {os.cpu_count()} cores; threads {first.get('threads')}; "
        f"torch {first.get('torch')}; transformers {first.get('transformers')}; "
        f"attention {first.get('attn_implementation')}; lomo_kernels backend "
        f"{', '.join(backends) or '-'}; {MMAP_ENV}={MMAP_VALUE}; steps "
        f"{first.get('steps')} (step 0 skipped)"
    )


def markdown_table(results: Sequence[dict[str, Any]], shapes: Sequence[tuple[int, int]]) -> str:
    """Rows = configs, columns = batch shapes, cells = peak above the model (MB)."""
    by_key = {(r["config"], r["batch"], r["seq"]): r for r in results}
    head = (
        "| configuration | "
        + " | ".join(f"batch {b} x {s}: peak above model (MB)" for b, s in shapes)
        + " |"
    )
    lines = [head, "|---|" + "---|" * len(shapes)]
    for config in CONFIGS:
        cells = []
        for b, s in shapes:
            r = by_key.get((config, b, s))
            if r is None:
                cells.append("")
            elif "error" in r:
                cells.append("error")
            else:
                cells.append(f"{r['peak_above_model_mb']:.0f}")
        lines.append(f"| {LABELS[config]} | " + " | ".join(cells) + " |")
    any_r = next((r for r in results if "model_mb" in r), None)
    if any_r is not None:
        largest = any_r["largest_param_numel"]
        lines.append("")
        lines.append(
            f"Model weights: {any_r['model_mb']:.0f} MB; largest parameter "
            f"{largest / 1e6:.1f}M elements ({largest * 2 / MB:.1f} MB as a bf16 "
            "gradient); MB = 2**20 bytes."
        )
        budgets = []
        for b, s in shapes:
            graph = by_key.get(("forward_graph", b, s), {}).get("peak_above_model_mb")
            if graph is not None:
                # The LOMO target: activations plus one gradient of the largest tensor, +5%.
                budgets.append(f"{b} x {s}: {(graph + largest * 2 / MB) * 1.05:.0f} MB")
        if budgets:
            lines.append(
                "LOMO target (activations + largest bf16 gradient, +5%): "
                + ", ".join(budgets)
                + "."
            )
    return "\n".join(lines)


def run_all(
    shapes: Sequence[tuple[int, int]], steps: int = 3, configs: Sequence[str] = CONFIGS
) -> list[dict[str, Any]]:
    results = []
    for config in configs:
        for batch, seq in shapes:
            try:
                r = run_isolated(config, batch, seq, steps)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                r = {"config": config, "batch": batch, "seq": seq, "error": str(exc)}
                print(r["error"], file=sys.stderr)
            results.append(r)
            print(
                f"{config} {batch}x{seq}: {r.get('peak_above_model_mb', 'error')}",
                file=sys.stderr,
                flush=True,
            )
    return results


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", choices=CONFIGS)
    parser.add_argument("--all", action="store_true", help="every config, fresh processes")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="one line of JSON")
    parser.add_argument("--json-out", default=None, help="--all: write the results here")
    args = parser.parse_args(argv)

    if args.all:
        if (args.batch is None) != (args.seq is None):
            parser.error("give both --batch and --seq, or neither")
        shapes = DEFAULT_SHAPES if args.batch is None else ((args.batch, args.seq),)
        results = run_all(shapes, args.steps)
        print(machine_line(results))
        print()
        print(markdown_table(results, shapes))
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(results, f, indent=1)
        return
    if args.config is None:
        parser.error("give a CONFIG or --all")
    batch = 2 if args.batch is None else args.batch
    seq = 256 if args.seq is None else args.seq
    result = run_isolated(args.config, batch, seq, args.steps)
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
