"""`python -m bench.head_sweeps`: the fused head's backward, what one more sweep over the
vocabulary costs.

    python -m bench.head_sweeps [--device cpu|cuda] [--tokens T] [--vocab V] [--hidden H]
                                   [--dtype fp32|bf16] [--repeats N] [--json F]

A sweep is `ops.cross_entropy.backward_by_chunks` over the whole vocabulary. Three variants,
interleaved, medians of `--repeats` runs after one warm-up each:

    full      d_hidden and every chunk's weight gradient (the backward of any head)
    measure   the weight gradient only (no d_hidden): what single_backward's measuring sweep
              of a Lomo-stepped head adds, and what each extra sweep of a block-wise AdaLomo
              would cost (its factored statistics, then its update RMS, need the whole
              gradient before the update: two more sweeps)
    hidden    d_hidden only (the weight gradient's products skipped: a frozen head)

The materialised alternative costs one ``vocab x hidden`` buffer in the weight's dtype and a
copy of each chunk into it (MiB printed). Ratios against `full` are what to read: on a
shared CPU absolute times drift (MEASURING.md).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from lomo_kernels.ops import cross_entropy as lce

from .common import machine
from .common.argtypes import (
    add_counts,
    add_device_argument,
    add_json_argument,
)
from .common.dtypes import DTYPES
from .common.meter import MIB
from .common.timing import WallClock, time_interleaved

IGNORE_INDEX = -100
TEMPERATURE = 1.0  # the loss's own (the logits undivided)


def run(
    device_name: str, tokens: int, vocab: int, hidden_size: int, dtype: str, repeats: int
) -> dict[str, Any]:
    """Each variant's median seconds, its ratio to `full`, and the buffers' sizes (MiB)."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, generator=gen).to(device_name, DTYPES[dtype])
    weight = torch.randn(vocab, hidden_size, generator=gen) / hidden_size**0.5
    weight = weight.to(device_name, DTYPES[dtype])
    labels = torch.randint(0, vocab, (tokens,), generator=gen).to(device_name)
    _, lse = lce.forward_impl(hidden, weight, labels, IGNORE_INDEX, TEMPERATURE)
    grad = torch.full((tokens,), 1.0 / tokens, device=device_name)
    base = (grad, hidden, weight, labels, lse, IGNORE_INDEX, TEMPERATURE)
    variants = {
        "full": lambda: lce.backward_by_chunks(base, lambda *_: None),
        "measure": lambda: lce.backward_by_chunks(base, lambda *_: None, with_d_hidden=False),
        "hidden": lambda: lce.backward_by_chunks(base, None),
    }
    medians = time_interleaved(variants, repeats, WallClock(device_name), warmup=1)
    return {
        "median_s": medians,
        "ratio_to_full": {name: medians[name] / medians["full"] for name in medians},
        "materialised_gradient_mib": vocab * hidden_size * weight.element_size() / MIB,
        "chunk_mib": lce.chunk_rows(vocab, hidden_size) * hidden_size * 4 / MIB,
    }


def format_lines(result: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [
        f"head {meta['vocab']} x {meta['hidden']}, {meta['tokens']} tokens, {meta['dtype']}: "
        f"one backward sweep, median of {meta['repeats']} interleaved runs",
        "| variant | median (ms) | vs full |",
        "|---|---|---|",
    ]
    for name, seconds in result["median_s"].items():
        lines.append(f"| {name} | {seconds * 1e3:.2f} | {result['ratio_to_full'][name]:.2f}x |")
    lines.append(
        f"materialised gradient: {result['materialised_gradient_mib']:.1f} MiB; one fp32 "
        f"chunk: {result['chunk_mib']:.1f} MiB"
    )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_device_argument(parser)
    add_counts(parser, tokens=1024, vocab=32000, hidden=256, repeats=5)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    add_json_argument(parser)


def command(args: argparse.Namespace) -> int:
    result = run(args.device, args.tokens, args.vocab, args.hidden, args.dtype, args.repeats)
    meta = machine.describe(args.device) | {
        key: getattr(args, key) for key in ("tokens", "vocab", "hidden", "dtype", "repeats")
    }
    machine.print_results(meta, format_lines(result, meta), args.json, **result)
    return 0


if __name__ == "__main__":
    from bench.common.cli import main

    sys.exit(main(__spec__.name))
