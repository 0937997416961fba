"""`python -m bench.head`: an LM head's loss, backward and update, fused and unfused.

One step of the head alone: ``loss = cross_entropy(hidden @ W.T, labels)``, its backward (the
gradient of `hidden` and of `W`, however each variant gives it) and the update of `W` by
the fused LOMO update. `hidden` stands for the last decoder layer's output (a leaf that
needs its gradient). Variants:

    unfused     transformers' way: fp32 logits, F.cross_entropy, W.grad, then the update
    fused       lomo_kernels' logits-free loss (`ops.linear_cross_entropy`), W.grad, update
    fused_lomo  the same loss with a `Lomo` owning W: W stepped in backward, from each
                vocabulary chunk's gradient where the head can be (no W-sized gradient)
    liger       liger-kernel's fused linear cross entropy (CUDA), W.grad, then the update
    cce         cut-cross-entropy's linear_cross_entropy (CUDA), W.grad, then the update

Per variant: the median step time over the timed steps (variants interleaved step by step,
so a shared machine slows them alike; MEASURING.md) and the peak of the tensor memory
allocated during one step above what existed before it (the profiler's allocator events,
the same count on CPU and CUDA). A variant whose package is missing or that needs another
device is reported as such, not run.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from lomo_kernels import Lomo
from lomo_kernels.ops import fused_lomo_update_, linear_cross_entropy

from .common import machine
from .common.argtypes import (
    add_counts,
    add_device_argument,
    add_json_argument,
    add_list_argument,
    positive_int,
)
from .common.dtypes import DTYPES
from .common.meter import tensor_balance
from .common.timing import WallClock, time_interleaved

VARIANTS = ("unfused", "fused", "fused_lomo", "liger", "cce")


class HeadShape(NamedTuple):
    """The head's weight, vocab x hidden, and the tokens of one step."""

    vocab: int
    hidden: int
    tokens: int


# `small` runs on any CPU in seconds; `llama-3-8b` is the head of that model (128,256 x 4096)
# at 8 x 2048 tokens per step.
SHAPES = {
    "small": HeadShape(32000, 512, 1024),
    "llama-2-7b": HeadShape(32000, 4096, 16384),
    "llama-3-8b": HeadShape(128256, 4096, 16384),
}
LR = 1e-4


class Head(nn.Module):
    """The head weight as a module, so a Lomo can own it."""

    def __init__(self, vocab: int, hidden: int, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, hidden, dtype=dtype, device=device) * 0.02)


def _update_from_grad(weight: torch.Tensor) -> None:
    with torch.no_grad():  # as an optimizer's step: nothing records the update
        fused_lomo_update_(weight, weight.grad, lr=LR)
    weight.grad = None


def _unfused(hidden: torch.Tensor, head: Head, labels: torch.Tensor) -> None:
    logits = (hidden @ head.weight.T).float()
    F.cross_entropy(logits, labels).backward()
    _update_from_grad(head.weight)


def _fused(hidden: torch.Tensor, head: Head, labels: torch.Tensor) -> None:
    linear_cross_entropy(hidden, head.weight, labels).backward()
    _update_from_grad(head.weight)


def _liger_loss() -> Callable[..., torch.Tensor]:
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    loss = LigerFusedLinearCrossEntropyLoss()
    return lambda hidden, weight, labels: loss(weight, hidden, labels)


def _cce_loss() -> Callable[..., torch.Tensor]:
    from cut_cross_entropy import linear_cross_entropy

    return linear_cross_entropy


def _with_library(loss_of: Callable[[], Callable[..., torch.Tensor]]) -> Callable[..., None]:
    loss = loss_of()

    def step(hidden: torch.Tensor, head: Head, labels: torch.Tensor) -> None:
        loss(hidden, head.weight, labels).backward()
        _update_from_grad(head.weight)

    return step


def _fused_lomo(head: Head) -> Callable[..., None]:
    optimizer = Lomo(head, lr=LR, clip_grad_norm=None)

    def step(hidden: torch.Tensor, head: Head, labels: torch.Tensor) -> None:
        optimizer.fused_backward(linear_cross_entropy(hidden, head.weight, labels), lr=LR)

    return step


def _build(variant: str, head: Head, device_type: str) -> Callable[..., None] | str:
    """The variant's step, or why it cannot run here."""
    if variant == "unfused":
        return _unfused
    if variant == "fused":
        return _fused
    if variant == "fused_lomo":
        return _fused_lomo(head)
    if device_type != "cuda":
        return "needs CUDA"
    try:
        return _with_library(_liger_loss if variant == "liger" else _cce_loss)
    except ImportError as exc:
        return f"not installed ({exc.name})"


def run(
    shape: HeadShape,
    variants: Sequence[str],
    device_name: str = "cpu",
    dtype: str | None = None,
    steps: int = 5,
    warmup: int = 1,
    seed: int = 0,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One row per variant: status, median step time, tensor peak of a step (bytes).
    `dtype`: by default bf16 where `device_name` multiplies it natively, else fp32."""
    vocab, hidden_size, tokens = shape
    dtype = dtype or machine.fast_dtype(device_name)
    torch.manual_seed(seed)
    torch_dtype = DTYPES[dtype]
    hidden = torch.randn(tokens, hidden_size, dtype=torch_dtype, device=device_name)
    hidden.requires_grad_(True)
    labels = torch.randint(0, vocab, (tokens,), device=device_name)
    rows = {v: {"variant": v, "status": "ok"} for v in variants}
    steps_of: dict[str, Callable[[], None]] = {}
    for variant in variants:
        head = Head(vocab, hidden_size, torch_dtype, device_name)
        built = _build(variant, head, torch.device(device_name).type)
        if isinstance(built, str):
            rows[variant]["status"] = built
        else:
            steps_of[variant] = _until_out_of_memory(built, hidden, head, labels, rows[variant])
    times = time_interleaved(steps_of, steps, WallClock(device_name), warmup=warmup)
    for variant, step in steps_of.items():
        if rows[variant]["status"] == "ok":
            peak, _ = tensor_balance(step, device_name)
            rows[variant].update(median_step_s=times[variant], step_peak_bytes=peak)
    meta = machine.describe(device_name) | {
        "vocab": vocab,
        "hidden": hidden_size,
        "tokens": tokens,
        "dtype": dtype,
        "steps": steps,
        "warmup": warmup,
    }
    return list(rows.values()), meta


def _until_out_of_memory(
    step: Callable[..., None],
    hidden: torch.Tensor,
    head: Head,
    labels: torch.Tensor,
    row: dict[str, Any],
) -> Callable[[], None]:
    """One step of a variant from a fresh `hidden` gradient; once it runs out of memory its
    row says OOM and it steps no more."""

    def one() -> None:
        if row["status"] != "ok":
            return
        hidden.grad = None
        try:
            step(hidden, head, labels)
        except torch.OutOfMemoryError:
            row["status"] = "OOM"

    return one


def format_table(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    base = next((r for r in rows if r["variant"] == "unfused" and r["status"] == "ok"), None)
    lines = [
        f"head {meta['vocab']} x {meta['hidden']}, {meta['tokens']} tokens, {meta['dtype']}: "
        f"loss + backward + update of the head, median of {meta['steps']} steps; peak: tensor "
        "memory allocated during a step (MiB)",
        "| variant | step (ms) | vs unfused | step peak (MiB) | vs unfused |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['variant']} | {r['status']} | | | |")
            continue
        ms, mib = r["median_step_s"] * 1e3, r["step_peak_bytes"] / 2**20
        time_ratio = f"{r['median_step_s'] / base['median_step_s']:.2f}x" if base else ""
        peak_ratio = (
            f"{r['step_peak_bytes'] / base['step_peak_bytes']:.3f}x"
            if base and base["step_peak_bytes"]
            else ""
        )
        lines.append(f"| {r['variant']} | {ms:.1f} | {time_ratio} | {mib:,.1f} | {peak_ratio} |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_device_argument(parser)
    parser.add_argument(
        "--shape",
        default="small",
        choices=sorted(SHAPES),
        help="vocab x hidden and tokens per step (default small: 32000 x 512, 1024 tokens)",
    )
    parser.add_argument("--vocab", type=positive_int, default=None, help="overrides --shape")
    parser.add_argument("--hidden", type=positive_int, default=None, help="overrides --shape")
    parser.add_argument("--tokens", type=positive_int, default=None, help="overrides --shape")
    parser.add_argument(
        "--dtype",
        default=None,
        choices=sorted(DTYPES),
        help="default: bf16 where this device multiplies it natively, else fp32",
    )
    add_counts(parser, steps=5, warmup=1, threads=1)
    add_list_argument(parser, "--variants", VARIANTS)
    add_json_argument(parser)


def command(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    given = {name: getattr(args, name) for name in HeadShape._fields}
    shape = SHAPES[args.shape]._replace(**{k: v for k, v in given.items() if v is not None})
    results, meta = run(shape, args.variants, args.device, args.dtype, args.steps, args.warmup)
    machine.print_results(meta, format_table(results, meta), args.json, results=results)
    return 0


if __name__ == "__main__":
    from bench.common.cli import main

    sys.exit(main(__spec__.name))
