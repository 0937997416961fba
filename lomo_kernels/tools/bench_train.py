"""End-to-end fine-tuning benchmark: tokens/s and peak memory per optimizer.

    lomo-kernels bench train [--device cpu|cuda] [--model tiny|llama-1b|llama-3-1b|llama-7b|
                             CONFIG.json] [--dtype bf16|fp16|fp32] [--batch B] [--seq S]
                             [--checkpointing] [--steps N] [--optimizers adamw,lomo,...]
                             [--fused-head] [--memory-cap-gib G] [--json F] [--plot F.png]

A LLaMA-architecture model of the named shape (random weights, nothing downloaded) is
fine-tuned for `--steps` steps on random token batches by each optimizer in turn, each in a
fresh process (`train_runner`), all from the same initial weights on the same batches.
Per optimizer: tokens/s and the median step time (warm-up steps left out), the peak memory
(CUDA: `max_memory_allocated`; CPU: the process's VmHWM, and both above the model), the
optimizer's state, the update's share of the step, or OOM where the step does not fit.

The update's share is 1 - t(forward_backward) / t(step): `forward_backward` is the same
forward and backward with no update at all (gradients dropped), run in its own process. It
is what choosing the optimizer costs over plain backpropagation: for the two-pass modes it
includes the second backward. All optimizers clip by global norm 1.0 (`--clip-grad-norm`).

CPU figures are CPU figures, never GPU timings; on CPU the steps run with
MALLOC_MMAP_THRESHOLD_=65536 (needed for VmHWM), which makes every large allocation a
system call: compare CPU step times between optimizers of one run, not with other runs.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence
from typing import Any

from .argtypes import (
    add_output_arguments,
    comma_list,
    device,
    model_name,
    non_negative_float,
    positive_float,
    positive_int,
    whole_number,
)
from .bench_memory import DTYPES, add_fused_head_argument
from .models import PRESETS, resolve_model
from .optimizers import DEFAULT_LR, FORWARD_BACKWARD, OPTIMIZERS, unavailable_reason
from .train_runner import Workload, run_isolated

DEFAULT_OPTIMIZERS = "adamw,sgd,lomo_optim,lomo,lomo_single,adalomo,adalomo_single"
ALIASES = {"lomo-optim": "lomo_optim"}


def random_batches(vocab: int, batch: int, seq: int, seed: int) -> Iterator[Any]:
    """Endless batches of uniformly random token ids, the same sequence for every seed."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randint(0, vocab, (batch, seq), generator=gen)


def build(spec: dict[str, Any]) -> Workload:
    """The workload of one `bench train` process (called by `train_runner`)."""
    import torch

    from .bench_memory import build_model

    torch.manual_seed(spec["seed"])
    model = build_model(spec["model"], spec["dtype"], spec["device"], spec["fused_head"])
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
    threads: int = 1,
    clip_grad_norm: float | None = 1.0,
    seed: int = 0,
    progress: bool = True,
    fused_head: bool = False,
    memory_cap_gib: float | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Each optimizer (and `forward_backward`) in its own process: (results, meta)."""
    from . import machine

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
    it: Any = todo
    if progress:
        from tqdm import tqdm

        it = tqdm(todo, desc="bench train", unit="process")
    raw: dict[str, dict[str, Any]] = {}
    for name in it:
        if hasattr(it, "set_postfix_str"):
            it.set_postfix_str(name)
        reason = unavailable_reason(name)
        if reason:
            raw[name] = {"optimizer": name, "status": "unavailable", "error": reason}
            continue
        raw[name] = run_isolated(
            __name__,
            spec,
            name,
            steps=warmup + steps,
            warmup=warmup,
            lr=DEFAULT_LR.get(name, 0.0),
            clip_grad_norm=clip_grad_norm,
            threads=threads,
        )
    base = raw.pop(FORWARD_BACKWARD)
    for result in raw.values():
        if result["status"] == "ok" and base["status"] == "ok":
            result["update_share"] = 1 - base["median_step_s"] / result["median_step_s"]
    shape = resolve_model(model)
    meta = machine.describe(device) | spec
    meta |= {
        "model": shape.name,
        "num_parameters": shape.num_parameters,
        "steps": steps,
        "warmup": warmup,
        "clip_grad_norm": clip_grad_norm,
        "forward_backward": base,
    }
    meta["threads"] = threads if not device.startswith("cuda") else meta["threads"]
    return [raw[name] for name in optimizers], meta


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
        f"memory: {peak}, MiB",
        "| optimizer | tokens/s | median step (ms) | update share | peak | above model | "
        "optimizer state | notes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        share = _cell(r, "update_share", ".0%")
        notes = r.get("implementation") or r.get("backend") or r.get("error", "")
        ms = r["median_step_s"] * 1e3 if r["status"] == "ok" else None
        lines.append(
            f"| {r['optimizer']} | {_cell(r, 'tokens_per_s', ',.0f')} | "
            f"{r['status'] if ms is None else format(ms, '.1f')} | {share} | "
            f"{_cell(r, 'peak_mib', ',.0f')} | {_cell(r, 'peak_above_model_mib', ',.0f')} | "
            f"{_cell(r, 'state_mib', ',.1f')} | {notes} |"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", type=device, default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument(
        "--model",
        type=model_name,
        default="tiny",
        help=f"{', '.join(PRESETS)} or a HF config.json path (random weights)",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="default: bf16 where bf16 matmuls are native (GPUs, CPUs with AVX-512 BF16 or "
        "AMX), else fp32",
    )
    parser.add_argument("--batch", type=positive_int, default=2)
    parser.add_argument("--seq", type=positive_int, default=128)
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    parser.add_argument(
        "--steps", type=positive_int, default=3, help="timed steps per optimizer (default 3)"
    )
    parser.add_argument(
        "--warmup",
        type=whole_number(1),
        default=1,
        help="untimed steps before them, outside the peak too (default 1)",
    )
    parser.add_argument(
        "--optimizers",
        type=comma_list(tuple(OPTIMIZERS), ALIASES),
        default=DEFAULT_OPTIMIZERS,
        help=f"comma list of {', '.join(OPTIMIZERS)}",
    )
    parser.add_argument(
        "--clip-grad-norm",
        type=non_negative_float,
        default=1.0,
        help="clip by global norm for every optimizer; 0: no clipping (default 1.0)",
    )
    parser.add_argument("--threads", type=positive_int, default=1, help="CPU threads (default 1)")
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
    from . import machine

    dtype = args.dtype or machine.fast_dtype(args.device)
    results, meta = run(
        args.model,
        args.optimizers,
        device=args.device,
        dtype=dtype,
        batch=args.batch,
        seq=args.seq,
        checkpointing=args.checkpointing,
        steps=args.steps,
        warmup=args.warmup,
        threads=args.threads,
        clip_grad_norm=args.clip_grad_norm or None,
        seed=args.seed,
        progress=not args.no_progress,
        fused_head=args.fused_head,
        memory_cap_gib=args.memory_cap_gib,
    )
    machine.print_results(meta, format_table(results, meta), args.json, results=results)
    if args.plot:
        from .plots import plot_train

        plot_train(results, meta, args.plot)
    return 0
