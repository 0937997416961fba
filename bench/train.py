"""End-to-end fine-tuning benchmark: tokens/s and peak memory per optimizer.

    python -m bench.train [--device cpu|cuda] [--model tiny|llama-1b|llama-3-1b|llama-7b|
                             CONFIG.json] [--dtype bf16|fp16|fp32] [--batch B] [--seq S]
                             [--checkpointing] [--steps N] [--rounds R]
                             [--optimizers adamw,lomo,...]
                             [--fused-head] [--memory-cap-gib G] [--json F] [--plot F.png]

A LLaMA-architecture model of the named shape (random weights, nothing downloaded) is
fine-tuned for `--steps` steps on random token batches by each optimizer in turn, each in a
fresh process (`train_runner.measure_isolated`), all from the same initial weights on the
same batches.
Per optimizer: tokens/s and the median step time (warm-up steps left out), the peak memory
(CUDA: `max_memory_allocated`; CPU: the process's VmHWM, and both above the model), the
optimizer's state, the update's share of the step, or OOM where the step does not fit.

Step times are the process's CPU time on a one-thread CPU run (a shared machine's other jobs
do not count), the wall clock otherwise (`train_runner.step_clock`). With `--rounds R` the
whole sequence of processes runs R times, each round in a rotated order, so a burst of load
on the machine hits every optimizer alike: the table gives the median of the rounds' medians
and their range (MEASURING.md's interleaving, one process per run). Memory comes from the
first round.

The *_accumulate optimizers run k = 4 micro-batches of `--batch` sequences per step (their
step trains on k times the batch, cut by the optimizer): tokens/s counts every micro-batch.
The update's share is 1 - k t(forward_backward) / t(step) (k = 1 for the others):
`forward_backward` is the same
forward and backward with no update at all (gradients dropped), run in its own process. It
is what choosing the optimizer costs over plain backpropagation: for the two-pass modes it
includes the second backward. All optimizers clip by global norm 1.0 (`--clip-grad-norm`).

CPU figures are CPU figures, never GPU timings; on CPU the steps run with
MALLOC_MMAP_THRESHOLD_=65536 (needed for VmHWM), which makes every large allocation a
system call: compare CPU step times between optimizers of one run, not with other runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from .common import machine
from .common.argtypes import (
    add_counts,
    add_device_argument,
    add_fused_head_argument,
    add_list_argument,
    add_model_argument,
    add_output_arguments,
    keyword_arguments,
    non_negative_float,
    positive_float,
    positive_int,
    whole_number,
)
from .common.dtypes import DTYPES
from .common.models import build_model, resolve_model
from .common.optimizers import (
    DEFAULT_LR,
    FORWARD_BACKWARD,
    OPTIMIZERS,
    micro_batches,
    unavailable_reason,
)
from .common.progress import with_progress
from .common.train_runner import Workload, measure_isolated, step_clock

DEFAULT_OPTIMIZERS = "adamw,sgd,lomo_optim,lomo,lomo_single,adalomo,adalomo_single"
ALIASES = {"lomo-optim": "lomo_optim"}


def random_batches(vocab: int, batch: int, seq: int, seed: int) -> Iterator[Any]:
    """Endless batches of uniformly random token ids, the same sequence for every seed."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randint(0, vocab, (batch, seq), generator=gen)


def build(spec: dict[str, Any]) -> Workload:
    """The workload of one `bench.train` process (called by `train_runner`)."""
    model = build_model(
        spec["model"],
        spec["dtype"],
        spec["device"],
        seed=spec["seed"],
        fused_head=spec["fused_head"],
    )
    if spec["checkpointing"]:
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batches = random_batches(model.config.vocab_size, spec["batch"], spec["seq"], spec["seed"])
    return Workload(model, batches)


def run(
    model: str,
    optimizers: Sequence[str],
    *,
    device: str = "cpu",
    dtype: str = "fp32",
    batch: int = 2,
    seq: int = 128,
    checkpointing: bool = False,
    steps: int = 3,
    warmup: int = 1,
    rounds: int = 1,
    threads: int = 1,
    clip_grad_norm: float | None = 1.0,
    seed: int = 0,
    progress: bool = True,
    fused_head: bool = False,
    memory_cap_gib: float | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Each optimizer (and `forward_backward`) in its own process: (results, meta)."""
    spec = {
        "model": model,
        "dtype": dtype,
        "device": device,
        "batch": batch,
        "seq": seq,
        "checkpointing": checkpointing,
        "seed": seed,
        "fused_head": fused_head,
        "memory_cap_gib": memory_cap_gib,
    }
    todo = [FORWARD_BACKWARD, *optimizers]
    # Round r starts r places further along the list, so no run is always first or last.
    order = [todo[(r + i) % len(todo)] for r in range(rounds) for i in range(len(todo))]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in todo}
    for name in with_progress(order, progress, "bench train", "process"):
        if runs[name] and runs[name][0]["status"] != "ok":
            continue  # out of memory or unavailable: once is the result
        reason = unavailable_reason(name)
        if reason:
            runs[name].append({"optimizer": name, "status": "unavailable", "error": reason})
            continue
        runs[name].append(
            measure_isolated(
                __name__,
                # A step of k micro-batches of --batch each (the same micro-batch as the
                # other optimizers'): k times the batch, cut by the optimizer's step.
                spec | {"batch": batch * micro_batches(name)},
                name,
                steps=warmup + steps,
                warmup=warmup,
                lr=DEFAULT_LR.get(name, 0.0),
                clip_grad_norm=clip_grad_norm,
                threads=threads,
            )
        )
    raw = {name: merge_rounds(results) for name, results in runs.items()}
    base = raw.pop(FORWARD_BACKWARD)
    for result in raw.values():
        if result["status"] == "ok" and base["status"] == "ok":
            # An accumulating step runs the forward and backward once per micro-batch.
            passes = result.get("accumulation_steps", 1)
            result["update_share"] = 1 - passes * base["median_step_s"] / result["median_step_s"]
    shape = resolve_model(model)
    meta = machine.describe(device) | spec
    meta |= {
        "model": shape.name,
        "num_parameters": shape.num_parameters,
        "steps": steps,
        "warmup": warmup,
        "clip_grad_norm": clip_grad_norm,
        "forward_backward": base,
        "rounds": rounds,
        "step_clock": step_clock(device, threads),
    }
    meta["threads"] = threads if not device.startswith("cuda") else meta["threads"]
    return [raw[name] for name in optimizers], meta


def merge_rounds(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One optimizer's runs over the rounds as one result: the first run that did not finish
    (OOM, unavailable) if any; else the first run with the median of the runs' median step
    times (and tokens/s from it) and each run's median in `round_median_step_s`."""
    for result in results:
        if result["status"] != "ok":
            return result
    medians = [r["median_step_s"] for r in results]
    median = statistics.median(medians)
    return results[0] | {
        "round_median_step_s": medians,
        "median_step_s": median,
        "tokens_per_s": results[0]["tokens_per_step"] / median,
    }


def _step_cell(result: dict[str, Any]) -> str:
    """The median step in ms, with the rounds' range when there were several."""
    if result["status"] != "ok":
        return result["status"]
    text = f"{result['median_step_s'] * 1e3:.1f}"
    rounds = result.get("round_median_step_s", [])
    if len(rounds) > 1:
        text += f" ({min(rounds) * 1e3:.1f}-{max(rounds) * 1e3:.1f})"
    return text


def _clock_text(meta: dict[str, Any]) -> str:
    clock = "process CPU time" if meta.get("step_clock") == "cpu" else "wall clock"
    rounds = meta.get("rounds", 1)
    if rounds == 1:
        return f"step times: {clock}"
    return f"step times: {clock}, median of {rounds} rounds of processes (their range)"


def _cell(result: dict[str, Any], key: str, fmt: str) -> str:
    if result["status"] != "ok":
        return result["status"]
    value = result.get(key)
    return "-" if value is None else format(value, fmt)


def _cap_text(cap_gib: float | None, cuda: bool) -> str:
    if cap_gib is None:
        return ""
    return f", memory capped at {cap_gib:g} GiB" + ("" if cuda else " (VmHWM compared)")


def format_table(results: Sequence[dict[str, Any]], meta: dict[str, Any]) -> str:
    cuda = str(meta["device"]).startswith("cuda")
    peak = "max_memory_allocated" if cuda else "VmHWM"
    base = meta["forward_backward"]
    base_ms = f"{base['median_step_s'] * 1e3:.1f} ms" if base["status"] == "ok" else base["status"]
    lines = [
        f"{meta['model']}: {meta['num_parameters'] / 1e6:.1f}M parameters, {meta['dtype']}, "
        f"batch {meta['batch']} x {meta['seq']}"
        f"{', activation checkpointing' if meta['checkpointing'] else ''}"
        f"{', fused head' if meta.get('fused_head') else ''}"
        f"{_cap_text(meta.get('memory_cap_gib'), cuda)}, "
        f"{meta['steps']} timed steps after {meta['warmup']} warm-up, clip by norm "
        f"{meta['clip_grad_norm']}; forward + backward without update: {base_ms}; "
        f"{_clock_text(meta)}; memory: {peak}, MiB",
        "| optimizer | tokens/s | median step (ms) | update share | peak | above model | "
        "optimizer state | notes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        share = _cell(r, "update_share", ".0%")
        notes = r.get("implementation") or r.get("backend") or r.get("error", "")
        lines.append(
            f"| {r['optimizer']} | {_cell(r, 'tokens_per_s', ',.0f')} | {_step_cell(r)} | "
            f"{share} | "
            f"{_cell(r, 'peak_mib', ',.0f')} | {_cell(r, 'peak_above_model_mib', ',.0f')} | "
            f"{_cell(r, 'state_mib', ',.1f')} | {notes} |"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_device_argument(parser)
    add_model_argument(parser, "tiny", " (random weights)")
    parser.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        default=None,
        help="default: bf16 where bf16 matmuls are native (GPUs, CPUs with AVX-512 BF16 or "
        "AMX), else fp32",
    )
    add_counts(parser, batch=2, seq=128)
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    parser.add_argument(
        "--steps", type=positive_int, default=3, help="timed steps per optimizer (default 3)"
    )
    parser.add_argument(
        "--rounds",
        type=positive_int,
        default=1,
        help="run every optimizer's process this many times, in rotated order; the table "
        "gives the median of the rounds and their range (default 1)",
    )
    parser.add_argument(
        "--warmup",
        type=whole_number(1),
        default=1,
        help="untimed steps before them, outside the peak too (default 1)",
    )
    add_list_argument(parser, "--optimizers", OPTIMIZERS, DEFAULT_OPTIMIZERS, aliases=ALIASES)
    parser.add_argument(
        "--clip-grad-norm",
        type=non_negative_float,
        default=1.0,
        help="clip by global norm for every optimizer; 0: no clipping (default 1.0)",
    )
    add_counts(parser, threads=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--memory-cap-gib",
        type=positive_float,
        default=None,
        help="the memory of a smaller GPU: CUDA allocations beyond it run out of memory; on "
        "CPU a peak (VmHWM) above it is reported as OOM",
    )
    add_fused_head_argument(parser)
    add_output_arguments(parser, "write the bars (PNG) here")


def command(args: argparse.Namespace) -> int:
    args.dtype = args.dtype or machine.fast_dtype(args.device)
    args.clip_grad_norm = args.clip_grad_norm or None  # 0: no clipping
    results, meta = run(**keyword_arguments(args, run))
    machine.print_results(meta, format_table(results, meta), args.json, results=results)
    if args.plot:
        from .common.plots import plot_train

        plot_train(results, meta, args.plot)
    return 0


if __name__ == "__main__":
    from bench.common.cli import main

    sys.exit(main(__spec__.name))
