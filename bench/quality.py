"""How much of a fine-tuning run's gain survives low-precision weights.

    python -m bench.quality [--device cpu|cuda] [--steps N] [--rows paper|all]
                               [--optimizers ...] [--workers W] [--json F] [--plot F.png]

A small LLaMA (character level, on the corpus shipped with the package) is pretrained in
fp32 with AdamW on the corpus's comparison, succession and counting sentences ("nine is
more than four.", "after eleven comes twelve."), reproducibly from a seed, and cached
(`LOMO_KERNELS_CACHE`, else ~/.cache/lomo_kernels). Each row then fine-tunes that checkpoint
on the arithmetic sentences ("seven plus five is twelve."), from the same weights on the
same batches, clipping by global norm 1.0, with a cosine schedule; 10% of the arithmetic
sentences are held out and measure the gain. The pretraining runs on the CPU (the same bits
on a given machine); the rows run on `--device`.

Rows: Lomo and AdaLomo at their papers' learning rates and at lower ones, each on fp32
weights, bf16 weights rounded to nearest (lomo-optim's rounding), bf16 and fp16 weights
with stochastic rounding (this package's default), and bf16 weights with a compensated
write-back (the rounding error carried to the next step in a bf16 buffer, +2 bytes per
parameter: emulated, see below); and AdamW with fp32 master weights, what users otherwise
run. Columns: the held-out loss before and after, the share of the same optimizer's
fp32-weights gain kept, and the peak memory above the model. Each row fine-tunes in a fresh
process (`train_runner`); the memory comes from a short metered run per optimizer and weights
dtype (4 steps, the process's VmHWM with the malloc setting of MEASURING.md, which slows
allocation, so the fine-tuning runs go without it).

Where the device does not multiply the storage dtype natively (CPUs without AVX-512 BF16 or
AMX for bf16, every CPU for fp16), low-precision weights are computed in fp32: the forward
casts each weight up as it uses it, the gradients arrive in the weights' dtype and the
optimizer writes back into them as always. The table says so; the memory column then
includes those fp32 copies. The compensated rows emulate a bf16 store with a bf16 error
buffer on fp32 parameters (values kept on the bf16 grid, gradients rounded to bf16): their
quality is what such a mode would give, and their memory column is the stochastic row's
plus the buffer, not a measurement.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .common import machine
from .common.argtypes import (
    add_device_argument,
    add_list_argument,
    add_output_arguments,
    output_path,
    positive_int,
)
from .common.char_model import (
    CORPUS,
    SIZES,
    build_model,
    char_ids,
    corpus_parts,
    held_out_loss,
    windows,
)
from .common.dtypes import DTYPES
from .common.meter import MIB
from .common.train_runner import Workload, measure_isolated

SIZE = "tiny"  # the demo's (hidden 128, 4 layers): 0.8M parameters
SEQ, BATCH = 64, 8
STEPS = 150  # the study's fine-tuning steps
# The demo's set-up (`make demo`), which the sweep runs: shorter and smaller batches, so
# that the demo answers in minutes on two cores (and the optimizer's memory counts more).
DEMO_STEPS, DEMO_BATCH = 100, 4
PRETRAIN = {"steps": 400, "lr": 3e-3, "batch": 16, "seed": 0}
CLIP = 1.0
# Learning rates: the papers' (LOMO: SGD at 1e-2; AdaLomo: 1e-3) and a few times lower.
LRS = {"lomo": (1e-2, 3e-3), "adalomo": (1e-3, 3e-4)}
ADAMW_LR = 1e-3
# The learning-rate sweep (--sweep): each optimizer on the demo's set-up, bf16 weights with
# its defaults, at each of these; the best held-out loss picks the demo's rate.
SWEEP_LRS = {
    "lomo": (1e-2, 3e-2, 1e-1, 3e-1, 1.0),
    "adalomo": (1e-3, 3e-3, 1e-2, 3e-2, 1e-1),
    "adamw_master": (3e-4, 1e-3, 3e-3, 1e-2),
}
LEARNING_RATES = CORPUS.parent / "demo_learning_rates.json"
# Steps of a metered run: a warm-up step (lazy state), then the peak over three steps.
MEMORY_STEPS = 4
# Storage variants: (weights dtype, rounding) -> label.
STORAGES = {
    ("fp32", "exact"): "fp32 weights",
    ("bf16", "nearest"): "bf16, round to nearest",
    ("bf16", "stochastic"): "bf16, stochastic (default)",
    ("fp16", "stochastic"): "fp16, stochastic (default)",
    ("bf16", "compensated"): "bf16 + bf16 error buffer (emulated)",
}


# Gradient accumulation rows: each step's batch cut into 4 micro-batches (`*_accumulate`),
# at the papers' learning rate, by (weights dtype, buffer) -> label.
ACCUMULATING = {"lomo_accumulate": "lomo", "adalomo_accumulate": "adalomo"}
ACCUMULATION = {
    ("fp32", "exact"): "fp32 weights, fp32 buffer",
    ("bf16", "stochastic"): "bf16, bf16 buffer (default)",
    ("bf16", "fp32 buffer"): "bf16, fp32 buffer",
    ("bf16", "int8 buffer"): "bf16, 8-bit blockwise buffer",
}
EMULATED = ("compensated",)
# The accumulation buffer dtype of each buffer row (None: the weights' dtype).
BUFFER_DTYPES = {"fp32 buffer": "fp32", "int8 buffer": "int8"}


@dataclass(frozen=True)
class Row:
    optimizer: str  # lomo, adalomo, adamw_master, or lomo/adalomo_accumulate
    lr: float
    dtype: str  # the weights' storage dtype
    # exact, nearest, stochastic or compensated (master: AdamW's fp32 copy); accumulating:
    # the buffer (`ACCUMULATION`)
    rounding: str

    @property
    def label(self) -> str:
        if self.optimizer in ACCUMULATING:
            return ACCUMULATION[self.dtype, self.rounding]
        if self.optimizer == "adamw_master" and self.dtype != "fp32":
            return f"{self.dtype} weights, fp32 master"
        if self.optimizer == "adamw_master":
            return "fp32 weights"
        return STORAGES[self.dtype, self.rounding]


OPTIMIZERS = (*LRS, "adamw_master", *ACCUMULATING)


def rows(kind: str, optimizers: Sequence[str] = OPTIMIZERS) -> list[Row]:
    """The benchmark's rows for `optimizers`: 'all' (both learning rates) or 'paper' (the
    papers' only)."""
    out = []
    for optimizer, lrs in LRS.items():
        if optimizer in optimizers:
            for lr in lrs if kind == "all" else lrs[:1]:
                out += [Row(optimizer, lr, dtype, rounding) for dtype, rounding in STORAGES]
    if "adamw_master" in optimizers:
        out.append(Row("adamw_master", ADAMW_LR, "bf16", "master"))
    for optimizer, base in ACCUMULATING.items():
        if optimizer in optimizers:
            out += [Row(optimizer, LRS[base][0], dtype, buffer) for dtype, buffer in ACCUMULATION]
    return out


# ----------------------------------------------------------------------------- pretraining


def cache_dir() -> Path:
    root = os.environ.get("LOMO_KERNELS_CACHE") or Path.home() / ".cache" / "lomo_kernels"
    return Path(root) / "quality"


# The pretrained checkpoint kept in the repository (`python -m bench.data.make_checkpoint`).
SHIPPED = CORPUS.parent


def checkpoint_name(size: str, pretrain: dict[str, Any]) -> str:
    """The pretrained weights' file name: keyed by the recipe, the model and the corpus, so a
    change of any gives a new name (and a shipped checkpoint of another recipe is not used)."""
    key = json.dumps({"pretrain": pretrain, "size": SIZES[size], "seq": SEQ}, sort_keys=True)
    digest = hashlib.sha256(key.encode() + CORPUS.read_bytes()).hexdigest()[:16]
    return f"pretrained-{size}-{digest}.pt"


def pretrained(size: str, pretrain: dict[str, Any], log: Callable[[str], None] = print) -> Path:
    """The pretrained checkpoint's path: the one shipped in bench/data/ or the cached one for
    this recipe, else made now and cached (`pretrain_into`)."""
    name = checkpoint_name(size, pretrain)
    for folder in (SHIPPED, cache_dir()):
        if (folder / name).exists():
            return folder / name
    path = cache_dir() / name
    pretrain_into(path, size, pretrain, log)
    return path


def pretrain_into(
    path: Path, size: str, pretrain: dict[str, Any], log: Callable[[str], None] = print
) -> None:
    """Pretrains the `size` model by `pretrain` into `path` (fp32, AdamW, one thread, from
    `pretrain["seed"]`: the same bits on a given machine and torch), a line every 50 steps."""
    steps = pretrain["steps"]
    log(f"pretraining the {size} model ({steps} AdamW steps, fp32) into {path}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    start = time.perf_counter()
    try:
        pre, _, held = corpus_parts()
        model = build_model(size, torch.float32, pretrain["seed"])
        opt = torch.optim.AdamW(model.parameters(), lr=pretrain["lr"])
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
        batches = windows(char_ids(pre), SEQ, pretrain["batch"], pretrain["seed"])
        for step in range(1, steps + 1):
            ids = next(batches)
            model(input_ids=ids, labels=ids).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            if step % 50 == 0 and step < steps:
                elapsed = time.perf_counter() - start
                left = elapsed / step * (steps - step)
                log(f"  step {step}/{steps}, {elapsed:.0f} s, about {left:.0f} s left")
        loss = held_out_loss(model, char_ids(held), SEQ, "cpu")
        took = time.perf_counter() - start
        log(f"pretrained in {took:.0f} s: held-out loss on the fine-tuning task {loss:.3f}")
    finally:
        torch.set_num_threads(threads)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save(model.state_dict(), tmp)
    tmp.replace(path)  # atomic: a parallel run never reads half a file


# ----------------------------------------------------------------------------- one row


def computes_natively(dtype: str, device: str) -> bool:
    """Whether `device` multiplies weights of `dtype` natively (else they compute in fp32)."""
    if dtype == "fp32" or str(device).startswith("cuda"):
        return True
    return dtype == "bf16" and machine.native_bf16_matmul(device)


class UpcastForward(torch.nn.Module):
    """A low-precision model whose forward runs in fp32: each weight is cast up where it is
    used (a differentiable cast, so its gradient arrives in the weight's dtype and the
    weight's hooks, the optimizer's, fire as usual)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, **kwargs: Any) -> Any:
        upcast = {
            name: t.float() if t.is_floating_point() else t
            for name, t in [*self.model.named_parameters(), *self.model.named_buffers()]
        }
        return torch.func.functional_call(self.model, upcast, args=(), kwargs=kwargs)


class CompensatedBf16:
    """The emulated compensated write-back on fp32 parameters holding bf16 values: after each
    step, ``v = p + c; p = bf16(v); c = bf16(v - p)`` (Kahan-style: the rounding error is
    carried into the next step in a bf16 buffer). The gradients are rounded to bf16 first, as
    a bf16 model's would be."""

    def __init__(self, model: Any) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        with torch.no_grad():
            for p in self.params:
                p.copy_(p.bfloat16())
                p.register_hook(lambda g: g.bfloat16().float())
        self.errors = [torch.zeros_like(p, dtype=torch.bfloat16) for p in self.params]

    def __call__(self) -> None:
        with torch.no_grad():
            for p, c in zip(self.params, self.errors, strict=True):
                v = p + c.float()
                p.copy_(v.bfloat16())
                c.copy_(v - p)


def build(spec: dict[str, Any]) -> Workload:
    """One row's workload (called by `train_runner` in the row's process)."""
    _, task, held = corpus_parts()
    device = spec.get("device", "cpu")
    compensated = spec["rounding"] == "compensated"
    dtype = torch.float32 if compensated else DTYPES[spec["dtype"]]
    model = build_model(spec["size"], dtype, spec["seed"], device)
    state = torch.load(spec["checkpoint"], map_location=device, weights_only=True)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            t.copy_(state[name])
    after_step = CompensatedBf16(model) if compensated else None
    native = computes_natively(spec["dtype"], device)
    forward = model if native or compensated else UpcastForward(model)
    held_ids = char_ids(held)
    seed = spec["seed"] + 1  # fine-tuning batches: not the pretraining's

    def cosine_schedule(opt: Any) -> Any:
        lr = opt.param_groups[0]["lr"]
        return torch.optim.lr_scheduler.CosineAnnealingLR(
            opt, T_max=spec["steps"], eta_min=lr * 0.1
        )

    def evaluate() -> float:
        return held_out_loss(forward, held_ids, spec["seq"], device)

    return Workload(
        forward,
        windows(char_ids(task), spec["seq"], spec["batch"], seed),
        evaluate=evaluate,
        make_scheduler=cosine_schedule,
        after_step=after_step,
    )


def run_row(
    row: Row, checkpoint: Path, steps: int, metered: bool = True, **settings: Any
) -> dict[str, Any]:
    """Fine-tunes with `row`'s set-up in a fresh process; its result. `metered`: its peak
    memory is measured (the process then allocates more slowly: `train_runner`).
    `settings`: size, batch, seq, seed, device, threads, clip_grad_norm, progress (defaults:
    the benchmark's)."""
    spec = {
        "size": settings.get("size", SIZE),
        "batch": settings.get("batch", BATCH),
        "seq": settings.get("seq", SEQ),
        "seed": settings.get("seed", PRETRAIN["seed"]),
        "device": settings.get("device", "cpu"),
        "dtype": row.dtype,
        "rounding": row.rounding,
        "checkpoint": str(checkpoint),
        "steps": steps,
    }
    options = None
    if row.optimizer in ACCUMULATING:
        options = {"stochastic_rounding": True}  # the default (fp32 weights: not rounded)
        if row.rounding in BUFFER_DTYPES:
            options["accumulation_dtype"] = BUFFER_DTYPES[row.rounding]
    elif row.optimizer.startswith(("lomo", "adalomo")):
        options = {"stochastic_rounding": row.rounding == "stochastic"}
    result = measure_isolated(
        __name__, spec, row.optimizer, steps=steps, lr=row.lr,
        clip_grad_norm=settings.get("clip_grad_norm", CLIP), options=options,
        threads=settings.get("threads", 1), progress=settings.get("progress", False),
        metered=metered,
    )  # fmt: skip
    return {**asdict(row), "label": row.label, **result}


# ----------------------------------------------------------------------------- results


def kept_shares(results: list[dict[str, Any]]) -> None:
    """Adds each row's share of its optimizer's fp32-weights gain at the same lr."""
    gains = {
        (r["optimizer"], r["lr"]): r["loss_before"] - r["loss_after"]
        for r in results
        if r["rounding"] == "exact"
    }
    for r in results:
        base = gains.get((r["optimizer"], r["lr"]))
        gain = r["loss_before"] - r["loss_after"]
        r["gain"] = gain
        r["kept"] = None if base is None or base <= 0 else gain / base


def memory_key(row: Row) -> tuple[str, str, str]:
    """Rows that hold the same memory: one optimizer on one storage dtype (the lr and the
    rounding do not change what is allocated; an accumulation buffer's dtype does)."""
    return row.optimizer, row.dtype, row.rounding if row.rounding in BUFFER_DTYPES else ""


def memory_rows(chosen: list[Row]) -> list[Row]:
    """One row per `memory_key`, measured in a short metered run; the emulated rows (the
    compensated write-back on fp32 parameters) have their memory modelled instead
    (`memory_columns`)."""
    picked: dict[tuple[str, str], Row] = {}
    for row in chosen:
        if row.rounding not in EMULATED:
            picked.setdefault(memory_key(row), row)
    return list(picked.values())


def memory_columns(results: list[dict[str, Any]], peaks: dict[tuple[str, str, str], float]) -> None:
    """The peak above the model from the metered runs (`peaks` by `memory_key`); the emulated
    rows modelled: the compensated ones the bf16 rows' peak plus the bf16 error buffer."""
    for r in results:
        row = Row(r["optimizer"], r["lr"], r["dtype"], r["rounding"])
        r["memory_mib"] = peaks[memory_key(row)]
        r["memory_note"] = ""
        if r["rounding"] == "compensated":
            buffer = r["num_parameters"] * 2 / MIB
            r["memory_mib"] += buffer
            r["memory_note"] = f"modelled: the bf16 rows' peak + {buffer:.1f} MiB buffer"


def compute_note(dtype: str, device: str = "cpu") -> str:
    return "native" if computes_natively(dtype, device) else "fp32 (upcast)"


def table(results: list[dict[str, Any]], device: str = "cpu") -> str:
    lines = [
        "| optimizer | lr | weights | computed in | held-out loss before -> after | "
        "share of fp32-weights gain kept | peak above model (MiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        kept = "-" if r["kept"] is None else f"{r['kept']:.0%}"
        if r["rounding"] == "exact":
            kept = "100% (reference)"
        compute = "fp32" if r["rounding"] == "compensated" else compute_note(r["dtype"], device)
        memory = f"{r['memory_mib']:.1f}" + (" (modelled)" if r["memory_note"] else "")
        lines.append(
            f"| {r['optimizer']} | {r['lr']:g} | {r['label']} | {compute} | "
            f"{r['loss_before']:.3f} -> {r['loss_after']:.3f} | {kept} | {memory} |"
        )
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: str, title: str) -> None:
    from .common.plots import _pyplot

    plt = _pyplot()
    shown = [r for r in results if r["kept"] is not None and r["rounding"] != "exact"]
    fig, ax = plt.subplots(figsize=(10, 4.2))
    names = [f"{r['optimizer']} {r['lr']:g}\n{r['label']}" for r in shown]
    colors = {"nearest": "#c44e52", "stochastic": "#4c72b0", "compensated": "#55a868"}
    ax.bar(range(len(shown)), [100 * r["kept"] for r in shown],
           color=[colors.get(r["rounding"], "#8172b2") for r in shown])  # fmt: skip
    ax.axhline(100, color="black", lw=0.8)
    ax.set_xticks(range(len(shown)), names, fontsize=6, rotation=60, ha="right")
    ax.set_ylabel("share of the fp32-weights gain kept (%)")
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    pretrain = {**PRETRAIN, "steps": args.pretrain_steps}
    checkpoint = pretrained(SIZE, pretrain, log)
    chosen = rows(args.rows, args.optimizers)
    log(
        f"fine-tuning the pretrained {SIZE} LLaMA for {args.steps} steps of {BATCH} x {SEQ} "
        f"characters, {len(chosen)} rows, {args.workers} at a time, one thread each"
    )
    if not computes_natively("bf16", args.device):
        log("this CPU has no native bf16 matmul: bf16- and fp16-stored weights compute in fp32")
    metered = memory_rows(chosen)
    jobs = [(row, args.steps, False) for row in chosen]
    jobs += [(row, MEMORY_STEPS, True) for row in metered]
    with ThreadPoolExecutor(args.workers) as pool:
        done = list(
            pool.map(
                lambda job: run_row(job[0], checkpoint, job[1], job[2], device=args.device), jobs
            )
        )
    results = done[: len(chosen)]
    peaks = {
        memory_key(row): r["peak_above_model_mib"]
        for row, r in zip(metered, done[len(chosen) :], strict=True)
    }
    kept_shares(results)
    memory_columns(results, peaks)
    info = machine.describe(args.device) | {"threads": 1, "torch": torch.__version__}
    meta = {
        "machine": info,
        "steps": args.steps,
        "pretrain": pretrain,
        "checkpoint": str(checkpoint),
    }
    log(machine.one_line(info))
    log(table(results, args.device))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": results}, indent=1))
        log(f"json: {args.json}")
    if args.plot:
        plot(results, args.plot, f"bench quality, {args.steps} steps: " + machine.one_line(info))
        log(f"plot: {args.plot}")
    return results


def sweep_rows(dtype: str = "bf16") -> list[Row]:
    """The sweep's rows: each optimizer at each of its `SWEEP_LRS`, `dtype` weights with its
    defaults (Lomo and AdaLomo: stochastic rounding; AdamW: fp32 master weights)."""
    return [
        Row(optimizer, lr, dtype, "master" if optimizer == "adamw_master" else "stochastic")
        for optimizer, lrs in SWEEP_LRS.items()
        for lr in lrs
    ]


def sweep(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Each optimizer's best learning rate on the demo's set-up (`SIZE`, `DEMO_BATCH` x `SEQ`,
    --steps), by the held-out loss after fine-tuning; written to --sweep-json for the demo."""
    pretrain = {**PRETRAIN, "steps": args.pretrain_steps}
    checkpoint = pretrained(SIZE, pretrain, log)
    chosen = sweep_rows()
    log(
        f"learning-rate sweep: {len(chosen)} runs of {args.steps} steps of {DEMO_BATCH} x {SEQ} "
        f"characters, {args.workers} at a time"
    )

    def one(row: Row) -> dict[str, Any]:
        result = run_row(row, checkpoint, args.steps, False, device=args.device, batch=DEMO_BATCH)
        log(f"  {row.optimizer} lr {row.lr:g}: held-out loss {result['loss_after']:.3f}")
        return result

    with ThreadPoolExecutor(args.workers) as pool:
        results = list(pool.map(one, chosen))
    optimizers = {}
    for optimizer, lrs in SWEEP_LRS.items():
        losses = {r["lr"]: r["loss_after"] for r in results if r["optimizer"] == optimizer}
        best = min(losses, key=losses.get)
        optimizers[optimizer] = {
            "lr": best,
            "held_out_loss": {f"{lr:g}": round(loss, 4) for lr, loss in losses.items()},
            "at_grid_edge": best in (lrs[0], lrs[-1]),
        }
    found = {
        "setup": {
            "size": SIZE,
            "steps": args.steps,
            "batch": DEMO_BATCH,
            "seq": SEQ,
            "weights": "bf16",
        },
        "checkpoint": checkpoint.name,
        "machine": machine.one_line(machine.describe(args.device) | {"threads": 1}),
        "optimizers": optimizers,
    }
    log(sweep_table(found))
    Path(args.sweep_json).write_text(json.dumps(found, indent=1) + "\n")
    log(f"learning rates: {args.sweep_json}")
    return found


def sweep_table(found: dict[str, Any]) -> str:
    """The sweep as a Markdown table: each optimizer's held-out loss per rate, the best bold."""
    lines = ["| optimizer | held-out loss per learning rate | best |", "|---|---|---|"]
    for optimizer, entry in found["optimizers"].items():
        cells = [
            f"**{lr}: {loss:.3f}**" if float(lr) == entry["lr"] else f"{lr}: {loss:.3f}"
            for lr, loss in entry["held_out_loss"].items()
        ]
        lines.append(f"| {optimizer} | {', '.join(cells)} | {entry['lr']:g} |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_device_argument(parser)
    parser.add_argument(
        "--steps", type=positive_int, default=None,
        help=f"fine-tuning steps (default {STEPS}; with --sweep the demo's, {DEMO_STEPS})",
    )  # fmt: skip
    parser.add_argument(
        "--pretrain-steps", type=positive_int, default=PRETRAIN["steps"],
        help="AdamW steps of the cached pretrained model",
    )  # fmt: skip
    parser.add_argument(
        "--rows", choices=("all", "paper"), default="all",
        help="all: the papers' and the lower learning rates; paper: the papers' only",
    )  # fmt: skip
    add_list_argument(parser, "--optimizers", OPTIMIZERS)
    parser.add_argument(
        "--workers", type=positive_int, default=2, help="rows run at once (one thread each)"
    )
    add_output_arguments(parser, "write a bar chart of the kept shares here")
    parser.add_argument(
        "--sweep", action="store_true",
        help="instead: each optimizer's best learning rate on the demo's set-up (--sweep-json)",
    )  # fmt: skip
    parser.add_argument(
        "--sweep-json", type=output_path, default=str(LEARNING_RATES),
        help="where --sweep writes the rates the demo uses (default: the demo's file)",
    )  # fmt: skip


def command(args: argparse.Namespace) -> int:
    if args.steps is None:
        args.steps = DEMO_STEPS if args.sweep else STEPS
    if args.sweep:
        sweep(args)
    else:
        run(args)
    return 0


if __name__ == "__main__":
    from bench.common.cli import main

    sys.exit(main(__spec__.name))
