"""`python -m bench.compile`: step time of a Lomo training step, eager against
torch.compile (method: MEASURING.md).

    python -m bench.compile [--repeats N] [--warmup W] [--hidden H --layers L --batch B
                               --seq S] [--dtype bf16|fp32] [--ways eager,...] [--json F]

Three loops on copies of one LLaMA-architecture model, each compiled in its own warm-up
steps, then timed interleaved (eager, compiled forward, compiled forward + compiled
autograd, eager, ...): the median step of each and the ratios of the medians, one process.
A step is forward + fused_backward (Lomo, clip_grad_norm=1.0: norm pass + update pass).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from lomo_kernels import Lomo

from .common import machine
from .common.argtypes import (
    add_counts,
    add_json_argument,
    add_list_argument,
    whole_number,
)
from .common.models import ModelShape, build_model
from .common.timing import time_interleaved

THREADS = 2
VOCAB = 8000
WAYS = {
    "eager": "eager",
    "compiled_forward": "compiled forward",
    "compiled_autograd": "compiled forward + compiled autograd",
}


def shape(hidden: int, layers: int) -> ModelShape:
    """A LLaMA of `hidden` width and `layers` layers: heads of 64, LLaMA's MLP proportion."""
    heads = max(1, hidden // 64)
    intermediate = hidden * 11 // 4
    return ModelShape(
        f"llama-h{hidden}-l{layers}", VOCAB, hidden, intermediate, layers, heads, heads
    )


def make_step(model: torch.nn.Module, way: str) -> Callable[[dict[str, Any]], None]:
    from lomo_kernels.core.torch_internals import enable_compiled_autograd

    opt = Lomo(model, lr=1e-3, clip_grad_norm=1.0)
    forward = model if way == "eager" else torch.compile(model)
    use_ca = way == "compiled_autograd"

    def step(inputs: dict[str, Any]) -> None:
        loss = forward(**inputs).loss
        if use_ca:
            with enable_compiled_autograd(torch.compile(backend="inductor")):
                opt.fused_backward(loss)
        else:
            opt.fused_backward(loss)

    return step


def run(
    ways: list[str],
    model: ModelShape,
    dtype: str,
    batch: tuple[int, int],
    repeats: int,
    warmup: int,
    log: Callable[[str], None] = print,
) -> tuple[dict[str, float], int]:
    """Median seconds per step of each way on `batch` (sequences x tokens) of random token
    ids, and the model's parameter count."""
    base = build_model(model, dtype, seed=0)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, batch, generator=gen)
    inputs = {"input_ids": ids, "labels": ids}
    steps = {way: make_step(copy.deepcopy(base), way) for way in ways}
    for way, step in steps.items():
        start = time.perf_counter()
        for _ in range(warmup):  # compiles, lazy state
            step(inputs)
        log(f"warm-up {WAYS[way]}: {time.perf_counter() - start:.1f} s")
    fns = {way: (lambda step=step: step(inputs)) for way, step in steps.items()}
    medians = time_interleaved(fns, repeats, warmup=0)
    return medians, sum(p.numel() for p in base.parameters())


def format_table(medians: dict[str, float]) -> str:
    eager = medians.get("eager")
    lines = ["| loop | median step (ms) | vs eager |", "|---|---|---|"]
    for way, median in medians.items():
        ratio = f"{median / eager:.2f}x" if eager else "-"
        lines.append(f"| {WAYS[way]} | {median * 1e3:.1f} | {ratio} |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_counts(parser, hidden=512, layers=4, batch=2, seq=128, repeats=15)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--warmup", type=whole_number(1), default=3)
    add_list_argument(parser, "--ways", WAYS)
    add_json_argument(parser)


def command(args: argparse.Namespace) -> int:
    torch.set_num_threads(THREADS)
    model = shape(args.hidden, args.layers)
    batch = (args.batch, args.seq)
    log = lambda line: print(line, flush=True)
    medians, params = run(args.ways, model, args.dtype, batch, args.repeats, args.warmup, log)
    import transformers

    meta = machine.describe("cpu") | {
        "transformers": transformers.__version__,
        "parameters": params,
        "model": model.as_dict(),
        "dtype": args.dtype,
        "batch": args.batch,
        "seq": args.seq,
        "repeats": args.repeats,
    }
    table = (
        f"model {params / 1e6:.0f}M params ({args.layers} layers, hidden {args.hidden}), "
        f"{args.dtype}, batch {args.batch} x {args.seq}; {args.repeats} interleaved repeats, "
        f"medians\n\n" + format_table(medians)
    )
    machine.print_results(meta, table, args.json, median_step_s=medians)
    return 0


if __name__ == "__main__":
    from bench.common.cli import main

    sys.exit(main(__spec__.name))
