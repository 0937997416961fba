"""`make demo`: fine-tune a pretrained small LLaMA with LOMO, AdaLomo and AdamW.

A character-level LLaMA pretrained (fp32, AdamW, cached on first use: `bench.quality`'s
checkpoint) on the shipped corpus's comparison and counting sentences is fine-tuned on its
arithmetic sentences ("seven plus five is twelve.") by each optimizer at a fine-tuning
learning rate, with the package's defaults: weights stored in bf16 and written back with
stochastic rounding, exact clipping by global norm 1.0, a cosine schedule. AdamW keeps fp32
master weights beside the bf16 model, as mixed-precision training does. Each optimizer also
fine-tunes the same checkpoint on fp32 weights, so the closing table says how much of the
fp32 quality each keeps (the held-out loss gain, 10% of the arithmetic sentences held out),
and at what memory and speed. Every run is a process of its own (`bench/common/train_runner.py`),
from the same weights on the same batches.

    python -m bench.demo [--optimizers lomo,lomo_single,adalomo,adamw_master]
                                [--steps N] [--dtype bf16|fp16] [--size tiny|small|base|wide]
                                [--plot demo.png]

The default model ("wide": hidden 512, 2 layers, 6.6M parameters) and batch (8 x 64
characters) are chosen so that what an optimizer holds is most of the step's memory, as in
fine-tuning a large model on short sequences: AdamW's fp32 master weights, gradients and two
fp32 moments are 7x the bf16 model, while LOMO holds one gradient at a time. Peak memory is
the process's VmHWM above what it holds once the model exists (CUDA: the allocator's peak
above the model), after a warm-up step. Where the CPU has no native bf16 matmul the bf16
weights compute in fp32 (cast up as each is used; the table says so) and the memory figures
include those casts. CPU timings are CPU timings, not GPU figures; with one thread they are
the process's CPU time (`train_runner.step_clock`).
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from .common.argtypes import (
    comma_list,
    device,
    plot_path,
    positive_float,
    positive_int,
    whole_number,
)
from .common.char_model import MAX_SEQ, MIN_SEQ, SIZES, build_model
from .common.optimizers import HOLDS_ALL_GRADIENTS
from .quality import (
    PRETRAIN,
    Row,
    compute_note,
    kept_shares,
    pretrained,
    run_row,
)

CHOICES = ("lomo", "lomo_single", "adalomo", "adalomo_single", "adamw_master", "sgd")
DEFAULT_OPTIMIZERS = "lomo,lomo_single,adalomo,adamw_master"
# Fine-tuning learning rates: the LOMO paper's SGD rate, the AdaLomo paper's, AdamW's usual.
FINE_TUNE_LR = {
    "lomo": 1e-2,
    "lomo_single": 1e-2,
    "adalomo": 1e-3,
    "adalomo_single": 1e-3,
    "adamw_master": 1e-3,
    "sgd": 1e-2,
}
BACKWARD_PASSES = {"lomo": 2, "adalomo": 2}  # exact clipping: a norm pass first; else 1
LOW_PRECISION = ("bf16", "fp16")


def _held_mib(r: dict[str, Any]) -> float:
    """What the optimizer holds at its step's peak: its state (AdamW: the moments), every
    gradient for the optimizers that keep them all, and AdamW's fp32 master weights (LOMO-style
    ones free each gradient in backward)."""
    grads = r["model_mib"] if r["optimizer"] in HOLDS_ALL_GRADIENTS else 0.0
    master = r["num_parameters"] * 4 / 2**20 if r.get("master") == "fp32" else 0.0
    return r["state_mib"] + grads + (master if r["dtype"] != "fp32" else 0.0)


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| optimizer | backward passes | lr | weights | held-out loss before -> after | "
        "of the fp32-weights gain | tokens/s | peak above model (MiB) | "
        "of which held by the optimizer (MiB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        kept = "reference" if r["dtype"] == "fp32" else f"{r['kept']:.0%}"
        lines.append(
            f"| {r['optimizer']} | {BACKWARD_PASSES.get(r['optimizer'], 1)} | {r['lr']:g} | "
            f"{r['label']} | {r['loss_before']:.3f} -> {r['loss_after']:.3f} | {kept} | "
            f"{r['tokens_per_s']:,.0f} | {r['peak_above_model_mib']:.0f} | {_held_mib(r):.0f} |"
        )
    return "\n".join(lines)


def verdict(results: list[dict[str, Any]]) -> str:
    """The trade-off in words, for the low-precision runs: quality kept, memory, speed."""
    low = [r for r in results if r["dtype"] != "fp32"]
    base = next((r for r in low if r["optimizer"] == "adamw_master"), None)
    lines = []
    for r in low:
        line = f"  {r['optimizer']}: keeps {r['kept']:.0%} of its fp32-weights gain"
        if base is not None and r is not base:
            line += (
                f", peak {r['peak_above_model_mib'] / base['peak_above_model_mib']:.2f}x "
                f"AdamW's, {r['tokens_per_s'] / base['tokens_per_s']:.2f}x its tokens/s, "
                f"held-out loss {r['loss_after']:.2f} (AdamW {base['loss_after']:.2f})"
            )
        lines.append(line)
    head = f"{low[0]['dtype']} weights, each against the same optimizer on fp32 weights:"
    return "\n".join([head, *lines])


def plot(results: list[dict[str, Any]], path: str, title: str) -> None:
    from .common.plots import _pyplot

    plt = _pyplot()
    low = [r for r in results if r["dtype"] != "fp32"]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(14, 4.2), width_ratios=(2, 1.2, 1))
    for r in results:
        style = "--" if r["dtype"] == "fp32" else "-"
        a.plot(r["losses"], style, lw=0.8, label=f"{r['optimizer']}, {r['dtype']} weights")
    a.set_xlabel("step")
    a.set_ylabel("training loss")
    a.legend(fontsize=7)
    a.grid(alpha=0.3)
    names = [r["optimizer"] for r in low]
    held = [_held_mib(r) for r in low]
    rest = [r["peak_above_model_mib"] - h for r, h in zip(low, held, strict=True)]
    b.bar(names, rest, color="#55a868", label="activations and workspace")
    b.bar(names, held, bottom=rest, color="#c44e52", label="held by the optimizer")
    b.set_ylabel("peak above the model (MiB, lower is better)")
    b.legend(fontsize=7)
    c.bar(names, [100 * r["kept"] for r in low], color="#4c72b0")
    c.axhline(100, color="black", lw=0.8)
    c.set_ylabel("% of the fp32-weights gain kept")
    for ax in (b, c):
        ax.tick_params(axis="x", labelsize=7, labelrotation=30)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--optimizers",
        type=comma_list(CHOICES),
        default=DEFAULT_OPTIMIZERS,
        help=f"comma list of {', '.join(CHOICES)}",
    )
    parser.add_argument("--size", choices=list(SIZES), default="wide")
    parser.add_argument(
        "--dtype",
        choices=LOW_PRECISION,
        default="bf16",
        help="the weights' dtype (each optimizer also runs on fp32 weights, the reference)",
    )
    parser.add_argument("--steps", type=positive_int, default=150)
    parser.add_argument("--batch", type=positive_int, default=8)
    parser.add_argument("--seq", type=whole_number(MIN_SEQ, MAX_SEQ), default=64)
    parser.add_argument("--lr", type=positive_float, default=None, help="default per optimizer")
    parser.add_argument("--clip-grad-norm", type=positive_float, default=1.0)
    parser.add_argument("--device", type=device, default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--threads", type=positive_int, default=1, help="CPU threads per run (1: shared machines)"
    )
    parser.add_argument(
        "--workers", type=positive_int, default=2, help="runs at once (each its own process)"
    )
    parser.add_argument("--pretrain-steps", type=positive_int, default=PRETRAIN["steps"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", type=plot_path, default=None, help="write the PNG here")


def banner(args: argparse.Namespace) -> str:
    from lomo_kernels.ops import backends

    hidden, _, layers, _ = SIZES[args.size]
    model = build_model(args.size, torch.float32, 0, "meta")
    n_params = sum(p.numel() for p in model.parameters())
    backend = backends.backend_name(backends.resolve(torch.device(args.device)))
    return (
        f"LLaMA architecture: {n_params / 1e6:.1f}M parameters (hidden {hidden}, {layers} "
        f"layers), pretrained, fine-tuned on {args.device} for {args.steps} steps of "
        f"{args.batch} x {args.seq} characters per run, each in its own process; Lomo "
        f"kernels: {backend} backend\n{args.dtype} weights, computed "
        f"{compute_note(args.dtype, args.device)}, and fp32 weights as the reference"
    )


def runs(args: argparse.Namespace) -> list[Row]:
    """Each optimizer on the chosen low-precision weights (default rounding), and on fp32."""
    out = []
    for name in args.optimizers:
        lr = FINE_TUNE_LR[name] if args.lr is None else args.lr
        low = "master" if name == "adamw_master" else "stochastic"
        out += [Row(name, lr, args.dtype, low), Row(name, lr, "fp32", "exact")]
    return out


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Fine-tune with each optimizer, print the table (and write the plot); the results."""
    from .common import machine

    print(banner(args), flush=True)
    pretrain = {**PRETRAIN, "steps": args.pretrain_steps, "seed": args.seed}
    checkpoint = pretrained(args.size, pretrain)
    settings = {
        key: getattr(args, key)
        for key in ("size", "batch", "seq", "seed", "device", "threads", "clip_grad_norm")
    }

    def one(row: Row) -> dict[str, Any]:
        result = run_row(row, checkpoint, args.steps, **settings)
        print(
            f"  {row.optimizer}, {row.label}: held-out loss {result['loss_before']:.3f} -> "
            f"{result['loss_after']:.3f}",
            flush=True,
        )
        return result

    with ThreadPoolExecutor(args.workers) as pool:
        results = list(pool.map(one, runs(args)))
    kept_shares(results)
    info = machine.describe(args.device) | {"threads": args.threads}
    print()
    print(machine.one_line(info))
    print(table(results))
    print(verdict(results))
    if args.plot:
        kind = "GPU timing" if "gpu" in info else "CPU timing (not a GPU figure)"
        title = f"demo, {args.size} LLaMA, {args.dtype}; {kind}: " + machine.one_line(info)
        plot(results, args.plot, title)
        print(f"plot: {args.plot}")
    for r in results:
        if not r["loss_after"] < r["loss_before"]:
            raise SystemExit(
                f"{r['optimizer']} ({r['label']}): the held-out loss did not fall: "
                "something is wrong"
            )
    return results


def command(args: argparse.Namespace) -> int:
    """The exit status of a demo run."""
    run(args)
    return 0


if __name__ == "__main__":
    from bench.common.cli import main

    sys.exit(main(__spec__.name))
