"""`make demo`: fine-tune a pretrained small LLaMA with LOMO, AdaLomo and AdamW, within three
minutes on an idle 2-core CPU, the C++ kernels' first build included.

A character-level LLaMA (0.8M parameters: hidden 128, 4 layers), pretrained in fp32 with
AdamW on the corpus's comparison and counting sentences (the checkpoint in bench/data/, made
by `python -m bench.data.make_checkpoint`; pretrained and cached here when it is missing),
is fine-tuned on the corpus's arithmetic sentences ("seven plus five is twelve.") by each
optimizer at its best learning rate (`python -m bench.quality --sweep` found them on this
set-up: bench/data/demo_learning_rates.json), with the package's defaults: weights stored in
bf16 and written back with stochastic rounding, exact clipping by global norm 1.0, a cosine
schedule. AdamW keeps fp32 master weights beside the bf16 model, as mixed-precision training
does. Each optimizer also fine-tunes the same checkpoint on fp32 weights, so the closing
table says how much of the fp32 quality each keeps (the held-out loss gain, 10% of the
arithmetic sentences held out), and at what memory and speed; the closing lines say what
LOMO buys (the model AdamW could fit in the same memory) and what it costs. Every run is a
process of its own (`bench/common/train_runner.py`), from the same weights on the same
batches; a line per phase says what runs and how long it should take.

    python -m bench.demo [--optimizers lomo,lomo_single,adalomo,adamw_master]
                         [--steps N] [--dtype bf16|fp16] [--size tiny|small|base|wide]
                         [--plot demo.png]

Peak memory is the process's VmHWM above what it holds once the model exists (CUDA: the
allocator's peak above the model), after a warm-up step. Where the CPU has no native bf16
matmul (AVX2-only CPUs, where a bf16 matmul is about 40x slower than fp32) the bf16 weights
compute in fp32 (cast up as each is used; the table says so), so the demo runs as fast there
and the memory figures include those casts. CPU timings are CPU timings, not GPU figures;
with one thread they are the process's CPU time (`train_runner.step_clock`).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
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
    DEMO_BATCH,
    DEMO_STEPS,
    LEARNING_RATES,
    PRETRAIN,
    SHIPPED,
    Row,
    checkpoint_name,
    compute_note,
    kept_shares,
    pretrained,
    run_row,
)

CHOICES = ("lomo", "lomo_single", "adalomo", "adalomo_single", "adamw_master", "sgd")
DEFAULT_OPTIMIZERS = "lomo,adalomo,adamw_master"
# Without a sweep for this set-up: the LOMO paper's SGD rate, the AdaLomo paper's, AdamW's
# usual. The one-backward variants and SGD take the rate swept for their family.
PAPER_LR = {"lomo": 1e-2, "adalomo": 1e-3, "adamw_master": 1e-3}
FAMILY = {"lomo_single": "lomo", "adalomo_single": "adalomo", "sgd": "lomo"}
BACKWARD_PASSES = {"lomo": 2, "adalomo": 2}  # exact clipping: a norm pass first; else 1
LOW_PRECISION = ("bf16", "fp16")
# What a run takes on an idle 2-core CPU (one thread each, two at a time), for the phase
# lines: seconds per run of 100 steps (process start, model, metered steps, evaluation), and
# the C++ kernels' first build (both families compiled at once).
RUN_S = {"tiny": 15, "small": 30, "base": 60, "wide": 45}
BUILD_S = 50
PRETRAIN_STEP_S = {"tiny": 0.15, "small": 0.45, "base": 0.9, "wide": 0.85}
# "What LOMO buys" at scale: the largest preset each optimizer fits on this GPU memory
# (`lomo-kernels estimate`, one sequence of 2048 tokens, activation checkpointing).
GPU_GIB = 24


class Progress:
    """Lines stamped with the time since the demo started."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.lock = threading.Lock()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def line(self, text: str) -> None:
        with self.lock:
            print(f"[{self.elapsed():5.0f} s] {text}", flush=True)


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


def largest_fit(optimizer: str, precision: str, gpu_gib: float = GPU_GIB) -> str | None:
    """The largest LLaMA preset `optimizer` fine-tunes in `gpu_gib` (`lomo-kernels
    estimate`: one sequence of 2048 tokens, activation checkpointing), or None."""
    from lomo_kernels.tools.estimate import estimate
    from lomo_kernels.tools.models import PRESETS

    fitting = [
        shape
        for name, shape in PRESETS.items()
        if estimate(name, optimizer, gpu_mem_gib=gpu_gib, precision=precision).fits
    ]
    if not fitting:
        return None
    shape = max(fitting, key=lambda shape: shape.num_parameters)
    return f"{shape.name} ({shape.num_parameters / 1e9:.1f}B parameters)"


def verdict(results: list[dict[str, Any]]) -> str:
    """The trade-off in words, for the low-precision runs: quality kept, memory, speed; then
    what LOMO buys and what it costs, against AdamW."""
    low = [r for r in results if r["dtype"] != "fp32"]
    base = next((r for r in low if r["optimizer"] == "adamw_master"), None)
    lines = [f"{low[0]['dtype']} weights, each against the same optimizer on fp32 weights:"]
    for r in low:
        line = f"  {r['optimizer']}: keeps {r['kept']:.0%} of its fp32-weights gain"
        if base is not None and r is not base:
            line += (
                f", peak {r['peak_above_model_mib'] / base['peak_above_model_mib']:.2f}x "
                f"AdamW's, {r['tokens_per_s'] / base['tokens_per_s']:.2f}x its tokens/s, "
                f"held-out loss {r['loss_after']:.2f} (AdamW {base['loss_after']:.2f})"
            )
        lines.append(line)
    lomo = [r for r in low if r is not base]
    if base is None or not lomo:
        return "\n".join(lines)
    best = min(lomo, key=lambda r: r["loss_after"])
    matched = best["loss_after"] <= base["loss_after"] + 0.005  # within the runs' noise
    held = {r["optimizer"]: _held_mib(r) for r in low}
    adamw_fits, lomo_fits = largest_fit("adamw", "mixed"), largest_fit("lomo", "bf16")
    lines += [
        "",
        f"What LOMO buys: memory. Here AdamW holds {held['adamw_master']:.1f} MiB for its "
        "master weights, gradients and moments; "
        + ", ".join(f"{r['optimizer']} {held[r['optimizer']]:.1f} MiB" for r in lomo)
        + ". At scale the weights and that state are the memory: on a "
        f"{GPU_GIB} GiB GPU (lomo-kernels estimate, 1 x 2048 tokens, checkpointing) AdamW with "
        f"fp32 master weights fits up to {adamw_fits or 'no preset'}, Lomo on bf16 weights up "
        f"to {lomo_fits or 'no preset'}.",
        f"What it costs: {'time' if matched else 'quality and time'}. The best of them, "
        f"{best['optimizer']}, ends at held-out loss {best['loss_after']:.3f} against AdamW's "
        f"{base['loss_after']:.3f} after the same {len(base['losses'])} steps, each at its best "
        f"learning rate ({'no worse' if matched else 'worse'}), at "
        f"{best['tokens_per_s'] / base['tokens_per_s']:.2f}x AdamW's tokens/s (exact clipping "
        "runs the backward twice; lomo_single once, as does accumulation_steps=k per "
        "micro-batch, for one buffer of 2 bytes per parameter).",
    ]
    return "\n".join(lines)


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
    parser.add_argument("--size", choices=list(SIZES), default="tiny")
    parser.add_argument(
        "--dtype",
        choices=LOW_PRECISION,
        default="bf16",
        help="the weights' dtype (each optimizer also runs on fp32 weights, the reference)",
    )
    parser.add_argument("--steps", type=positive_int, default=DEMO_STEPS)
    parser.add_argument("--batch", type=positive_int, default=DEMO_BATCH)
    parser.add_argument("--seq", type=whole_number(MIN_SEQ, MAX_SEQ), default=64)
    parser.add_argument(
        "--lr", type=positive_float, default=None,
        help="one rate for every optimizer (default: each one's best from the sweep)",
    )  # fmt: skip
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
    hidden, _, layers, _ = SIZES[args.size]
    model = build_model(args.size, torch.float32, 0, "meta")
    n_params = sum(p.numel() for p in model.parameters())
    return (
        f"LLaMA architecture: {n_params / 1e6:.1f}M parameters (hidden {hidden}, {layers} "
        f"layers), pretrained, fine-tuned on {args.device} for {args.steps} steps of "
        f"{args.batch} x {args.seq} characters per run, each in its own process\n"
        f"{args.dtype} weights, computed {compute_note(args.dtype, args.device)}, and fp32 "
        "weights as the reference"
    )


def learning_rates(args: argparse.Namespace) -> tuple[dict[str, float], str]:
    """Each optimizer's rate and where it comes from: --lr; else the sweep's best
    (`bench.quality --sweep`) where it ran on this set-up; else the papers'."""
    if args.lr is not None:
        return dict.fromkeys(CHOICES, args.lr), "--lr"
    setup = {"size": args.size, "steps": args.steps, "batch": args.batch, "seq": args.seq}
    found = json.loads(LEARNING_RATES.read_text()) if LEARNING_RATES.exists() else {}
    swept = found.get("optimizers", {})
    if {k: found.get("setup", {}).get(k) for k in setup} != setup or args.dtype != "bf16":
        swept, source = (
            {},
            "the papers' (no sweep for this set-up: python -m bench.quality --sweep)",
        )
    else:
        source = f"each one's best of a sweep ({LEARNING_RATES.name})"
    rates = {name: swept.get(name, {}).get("lr", lr) for name, lr in PAPER_LR.items()}
    return rates | {name: rates[family] for name, family in FAMILY.items()}, source


def runs(args: argparse.Namespace, rates: dict[str, float]) -> list[Row]:
    """Each optimizer on the chosen low-precision weights (default rounding), and on fp32."""
    out = []
    for name in args.optimizers:
        low = "master" if name == "adamw_master" else "stochastic"
        out += [Row(name, rates[name], args.dtype, low), Row(name, rates[name], "fp32", "exact")]
    return out


def load_kernels(device_name: str, progress: Progress) -> str:
    """The backend the fused updates run on here, its extensions loaded (on the CPU, the C++
    kernels are compiled on first use: both families at once, one compiler each)."""
    from lomo_kernels.ops import backends

    device_type = torch.device(device_name).type
    if device_type == "cpu":
        progress.line(
            f"phase 1/3: the C++ CPU kernels (compiled the first time: about {BUILD_S} s on 2 "
            "cores; then loaded in a second)"
        )
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda r: r.load("cpp", "cpu"), (backends.LOMO, backends.ADALOMO)))
    else:
        progress.line("phase 1/3: the GPU kernels")
    return backends.backend_name(backends.resolve(torch.device(device_name)))


def starting_model(args: argparse.Namespace, progress: Progress) -> Any:
    """The pretrained checkpoint's path: the shipped one, a cached one, or pretrained now."""
    pretrain = {**PRETRAIN, "steps": args.pretrain_steps, "seed": args.seed}
    name = checkpoint_name(args.size, pretrain)
    if (SHIPPED / name).exists():
        progress.line(f"phase 2/3: the pretrained model, bench/data/{name}")
    else:
        expected = args.pretrain_steps * PRETRAIN_STEP_S[args.size]
        progress.line(
            f"phase 2/3: the pretrained model (not shipped for this recipe: cached, or "
            f"pretrained now in about {expected:.0f} s the first time)"
        )
    return pretrained(args.size, pretrain, lambda text: progress.line("  " + text.strip()))


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Fine-tune with each optimizer, print the table (and write the plot); the results."""
    from .common import machine

    progress = Progress()
    print(banner(args), flush=True)
    backend = load_kernels(args.device, progress)
    progress.line(f"  Lomo kernels: {backend} backend")
    checkpoint = starting_model(args, progress)
    rates, source = learning_rates(args)
    chosen = runs(args, rates)
    settings = {
        key: getattr(args, key)
        for key in ("size", "batch", "seq", "seed", "device", "threads", "clip_grad_norm")
    }
    per_run = RUN_S.get(args.size, 60) * args.steps / 100
    rounds = -(-len(chosen) // args.workers)
    progress.line(
        f"phase 3/3: fine-tuning, {len(chosen)} runs of {args.steps} steps, {args.workers} at a "
        f"time (about {rounds * per_run:.0f} s on an idle 2-core CPU); learning rates: "
        f"{source}: " + ", ".join(f"{name} {rates[name]:g}" for name in args.optimizers)
    )
    done: list[float] = []

    def one(row: Row) -> dict[str, Any]:
        started = time.perf_counter()
        result = run_row(row, checkpoint, args.steps, **settings)
        done.append(time.perf_counter() - started)
        left = -(-(len(chosen) - len(done)) // args.workers) * sum(done) / len(done)
        progress.line(
            f"  [{len(done)}/{len(chosen)}] {row.optimizer}, {row.label}: held-out loss "
            f"{result['loss_before']:.3f} -> {result['loss_after']:.3f} "
            f"({done[-1]:.0f} s{f'; about {left:.0f} s left' if left else ''})"
        )
        return result

    with ThreadPoolExecutor(args.workers) as pool:
        results = list(pool.map(one, chosen))
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
    progress.line("done")
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
