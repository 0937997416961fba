"""The fused head's backward: what one more sweep over the vocabulary costs.

    python bench/head_sweeps.py [--device cpu|cuda] [--tokens T] [--vocab V] [--hidden H]
        [--dtype fp32|bf16] [--repeats N] [--json-out PATH]

A sweep is `ops.cross_entropy.backward_by_chunks` over the whole vocabulary. Three variants,
interleaved, medians of `--repeats` runs after one warm-up each:

    full      d_hidden and every chunk's weight gradient (the backward of any head)
    measure   the weight gradient only (no d_hidden): what single_backward's measuring sweep
              of a Lomo-stepped head adds, and what each extra sweep of a block-wise AdaLomo
              would cost (its factored statistics, then its update RMS, need the whole
              gradient before the update: two more sweeps)
    hidden    d_hidden only (the weight gradient's products skipped: a frozen head)

The materialised alternative costs one ``vocab x hidden`` buffer in the weight's dtype and a
copy of each chunk into it (bytes printed). Ratios against `full` are what to read: on a
shared CPU absolute times drift (MEASURING.md).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lomo_kernels.ops import cross_entropy as lce  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=gen).to(device, dtype)
    weight = (torch.randn(args.vocab, args.hidden, generator=gen) / args.hidden**0.5).to(
        device, dtype
    )
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=gen).to(device)
    _, lse = lce.forward_impl(hidden, weight, labels, -100)
    grad = torch.full((args.tokens,), 1.0 / args.tokens, device=device)
    base = (grad, hidden, weight, labels, lse, -100)
    variants = {
        "full": lambda: lce.backward_by_chunks(*base, lambda *_: None),
        "measure": lambda: lce.backward_by_chunks(*base, lambda *_: None, with_d_hidden=False),
        "hidden": lambda: lce.backward_by_chunks(*base, None),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for run in range(args.repeats + 1):
        for name, fn in variants.items():
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            if run:  # the first round warms up
                times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    result = {
        "machine": platform.processor() or platform.machine(),
        "device": str(device),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "tokens": args.tokens,
        "vocab": args.vocab,
        "hidden": args.hidden,
        "dtype": args.dtype,
        "median_s": medians,
        "ratio_to_full": {name: medians[name] / medians["full"] for name in medians},
        "materialised_gradient_mib": args.vocab * args.hidden * weight.element_size() / 2**20,
        "chunk_mib": lce.chunk_rows(args.vocab, args.hidden) * args.hidden * 4 / 2**20,
    }
    print(json.dumps(result, indent=1))
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
