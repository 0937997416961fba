"""`python -m bench.single_backward`: step time with single_backward=True against the exact
two-pass mode (one process).

    python -m bench.single_backward [--device cpu|cuda] [--steps N] [--threads T]
        [--batch B] [--seq L] [--configs lomo-bf16,adalomo-bf16,...] [--json F]

A step is forward + `fused_backward` (for the exact mode that is the norm pass and the
update pass; for single_backward=True one backward). For each configuration the two modes
run on two copies of the same model, interleaved (exact, single, exact, single, ...), after
two warm-up steps each, on the same batches; the figure is the ratio of the median step
times, as MEASURING.md asks (absolute times on a shared machine vary, ratios taken in one
run hold).
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from lomo_kernels import AdaLomo, Lomo

from .common import machine
from .common.argtypes import (
    add_counts,
    add_device_argument,
    add_json_argument,
    add_list_argument,
)
from .common.models import ModelShape, build_model
from .common.timing import WallClock, time_interleaved

MODEL = ModelShape("llama-7m", 8000, 256, 688, 4, 4, 4)
MAX_POSITIONS = 256
WARMUP = 2
# name: (label, optimizer, model dtype, keyword arguments). fp16 matmuls are very slow on
# CPU (seconds per step here): a figure for the overflow path, not a training speed.
CONFIGS = {
    "lomo-bf16": ("Lomo clip_grad_norm=1, bf16", Lomo, "bf16", {"clip_grad_norm": 1.0}),
    "adalomo-bf16": ("AdaLomo clip_grad_norm=1, bf16", AdaLomo, "bf16", {"clip_grad_norm": 1.0}),
    "lomo-fp16": ("Lomo fp16 (loss scaling)", Lomo, "fp16", {}),
    "lomo-fp32": ("Lomo clip_grad_norm=1, fp32", Lomo, "fp32", {"clip_grad_norm": 1.0}),
}
MODES = {"exact": False, "single": True}  # name: single_backward


def batches(batch: int, seq: int, device: str) -> Iterator[torch.Tensor]:
    """Endless random token batches, the same sequence for every caller."""
    gen = torch.Generator().manual_seed(0)
    while True:
        yield torch.randint(0, MODEL.vocab_size, (batch, seq), generator=gen).to(device)


def step_of(
    model: torch.nn.Module, optimizer: Any, inputs: Iterator[torch.Tensor]
) -> Callable[[], None]:
    def step() -> None:
        ids = next(inputs)
        optimizer.fused_backward(model(input_ids=ids, labels=ids).loss)

    return step


def run(config: str, steps: int, batch: int, seq: int, device: str = "cpu") -> dict[str, Any]:
    """Both modes of `config`: their median step times (ms) and single / exact."""
    label, cls, dtype, kwargs = CONFIGS[config]
    base = build_model(MODEL, dtype, device, seed=0, max_position_embeddings=MAX_POSITIONS)
    steps_of = {}
    for mode, single in MODES.items():
        model = copy.deepcopy(base)
        optimizer = cls(model, lr=1e-3, single_backward=single, **kwargs)
        steps_of[mode] = step_of(model, optimizer, batches(batch, seq, device))
    medians = time_interleaved(steps_of, steps, WallClock(device), warmup=WARMUP)
    return {
        "config": label,
        "exact_ms": medians["exact"] * 1e3,
        "single_ms": medians["single"] * 1e3,
        "ratio": medians["single"] / medians["exact"],
    }


def format_table(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"batch {meta['batch']}x{meta['seq']}, median of {meta['steps']} interleaved steps",
        f"{'configuration':34} {'exact (ms)':>11} {'single (ms)':>12} {'single/exact':>13}",
    ]
    for r in results:
        lines.append(
            f"{r['config']:34} {r['exact_ms']:11.1f} {r['single_ms']:12.1f} {r['ratio']:13.3f}"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_device_argument(parser)
    add_counts(parser, steps=12, threads=1, batch=2, seq=128)
    add_list_argument(parser, "--configs", CONFIGS)
    add_json_argument(parser)


def command(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    import transformers

    meta = machine.describe(args.device) | {
        "transformers": transformers.__version__,
        "model": MODEL.as_dict(),
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
    }
    results = [run(name, args.steps, args.batch, args.seq, args.device) for name in args.configs]
    machine.print_results(meta, format_table(results, meta), args.json, results=results)
    return 0


if __name__ == "__main__":
    from bench.common.cli import main

    sys.exit(main(__spec__.name))
