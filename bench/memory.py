"""`python -m bench.memory`: peak memory of one training step per configuration, split
like the LOMO paper's Figure 2.

    python -m bench.memory [--model llama-168m] [--device cpu|cuda] [--dtype bf16|fp16|fp32]
                              [--batch B --seq S | --shapes 1x64,2x256] [--steps N]
                              [--optimizers adamw,sgd,lomo_optim,lomo,adalomo | all]
                              [--fused-head] [--json F] [--plot F.png]

Each configuration runs at each batch shape in a fresh process (`process.run_isolated`),
the model built directly in its dtype; the readings are `meter`'s (MEASURING.md): on CPU
the process's VmHWM above its VmRSS once the model, the inputs and the optimizer exist, on
CUDA the caching allocator's peak above `memory_allocated()`. Step 0 is not measured (lazy
state, first-call allocations); the figure is the max over the following steps. MiB = 2**20
bytes. Each process also gives the peak above the RSS at the step's start (compiled code
and Inductor's caches stay resident after step 0) and the peak of the tensors one more,
profiled, step allocates (`meter.tensor_balance`): the `raw` results of `--json`.

The split of a peak (stacked bars): parameters = the model's bytes; optimizer states = the
bytes of the optimizer's state tensors after the run; activations = the peak of a forward
pass keeping its graph (config `forward_graph`, its own process, same batch); gradients =
the rest of the peak (peak above the model - states - activations, at least 0). That last
part also holds each optimizer's transient workspace (e.g. lomo-optim's fp32 copies), and
where the peak falls inside backward before the gradients exist it is small: it is a
measured remainder, not a count of gradient tensors.

With several shapes, a last table gives each configuration's peak above the model per
shape, and the LOMO target: the activations plus one gradient of the largest parameter,
+5%. A configuration whose process fails is reported as an error, the others still run, and
the command exits with status 1.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

from .common import machine
from .common.argtypes import (
    add_counts,
    add_device_argument,
    add_fused_head_argument,
    add_model_argument,
    add_output_arguments,
    comma_list,
    keyword_arguments,
    whole_number,
)
from .common.dtypes import DTYPES
from .common.meter import MIB, Meter, require_metered_process, tensor_balance
from .common.models import build_model, resolve_model
from .common.optimizers import ACCUMULATION_STEPS, state_bytes
from .common.process import ProcessFailed, run_isolated
from .common.progress import with_progress

THREADS = 2
LR = 1e-3
DEFAULT_MODEL = "llama-168m"
TIMEOUT_S = 900
# The LOMO target's margin over the activations plus the largest gradient.
TARGET_MARGIN = 1.05

CONFIGS = (
    "forward_nograd",
    "forward_graph",
    "sgd",
    "adamw",
    "official_lomo",
    "lomo",
    "lomo_clip",
    "adalomo",
    "lomo_accumulate",
    "lomo_accumulate_int8",
    "lomo_compiled_forward",
    "lomo_compiled_autograd",
    "lomo_compiled_layers",
)
COMPILED = ("lomo_compiled_forward", "lomo_compiled_autograd", "lomo_compiled_layers")
OPTIMIZER_CONFIGS = ("adamw", "sgd", "official_lomo", "lomo", "adalomo")
# Names accepted on the command line for the optimizer configurations.
ALIASES = {"lomo_optim": "official_lomo", "lomo-optim": "official_lomo"}
LABELS = {
    "forward_nograd": "forward under no_grad",
    "forward_graph": "forward keeping the autograd graph (activations)",
    "sgd": "torch.optim.SGD (backward, step, zero_grad(set_to_none))",
    "adamw": "torch.optim.AdamW",
    "official_lomo": "lomo_optim.Lomo (official)",
    "lomo": "lomo_kernels.Lomo (fused_backward)",
    "lomo_clip": "lomo_kernels.Lomo, clip_grad_norm=1.0 (grad_norm + fused_backward)",
    "adalomo": "lomo_kernels.AdaLomo",
    "lomo_accumulate": "lomo_kernels.Lomo, accumulation_steps=4 (4 micro-batches of the shape)",
    "lomo_accumulate_int8": "lomo_kernels.Lomo, accumulation_steps=4, the 8-bit buffer",
    "lomo_compiled_forward": "lomo_kernels.Lomo, torch.compile(model), eager backward",
    "lomo_compiled_autograd": "lomo_kernels.Lomo, torch.compile(model) + compiled autograd",
    "lomo_compiled_layers": "lomo_kernels.Lomo, each decoder layer compiled, eager backward",
}
SHORT = {
    "sgd": "SGD",
    "adamw": "AdamW",
    "official_lomo": "lomo-optim",
    "lomo": "Lomo (ours)",
    "lomo_clip": "Lomo+clip (ours)",
    "adalomo": "AdaLomo (ours)",
    "lomo_accumulate": "Lomo k=4 (ours)",
    "lomo_accumulate_int8": "Lomo k=4, 8-bit buffer (ours)",
    "lomo_compiled_forward": "Lomo, compiled fwd",
    "lomo_compiled_autograd": "Lomo, compiled fwd + CA",
    "lomo_compiled_layers": "Lomo, compiled layers",
}


# -- one step ---------------------------------------------------------------------------------
def make_step(config: str, model: Any) -> tuple[Callable[[Any, Any], None], Any, dict[str, Any]]:
    """The per-step function of `config`, its optimizer (or None) and notes for the report."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    notes: dict[str, Any] = {}
    opt: Any = None

    def loss_of(ids: Any, labels: Any) -> Any:
        return model(input_ids=ids, labels=labels).loss

    if config == "forward_nograd":

        def step(ids: Any, labels: Any) -> None:
            with torch.no_grad():
                loss_of(ids, labels)
    elif config == "forward_graph":

        def step(ids: Any, labels: Any) -> None:
            loss = loss_of(ids, labels)
            del loss  # dropping the loss frees the graph and its saved activations
    elif config in ("sgd", "adamw"):
        opt = (
            torch.optim.SGD(params, lr=LR) if config == "sgd" else torch.optim.AdamW(params, lr=LR)
        )

        def step(ids: Any, labels: Any) -> None:
            loss_of(ids, labels).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    elif config == "official_lomo":
        import lomo_optim

        opt = lomo_optim.Lomo(model, lr=LR)

        def step(ids: Any, labels: Any) -> None:
            opt.fused_backward(loss_of(ids, labels), LR)
    elif config in COMPILED:
        import contextlib

        import lomo_kernels
        from lomo_kernels.core.torch_internals import enable_compiled_autograd

        opt = lomo_kernels.Lomo(model, lr=LR)
        if config == "lomo_compiled_layers":
            for layer in model.model.layers:
                layer.compile()  # in place; autograd runs eagerly between the layers
            forward = model
        else:
            forward = torch.compile(model)
        backward_ctx = (
            (lambda: enable_compiled_autograd(torch.compile(backend="inductor")))
            if config == "lomo_compiled_autograd"
            else contextlib.nullcontext
        )

        def step(ids: Any, labels: Any) -> None:
            loss = forward(input_ids=ids, labels=labels).loss
            with backward_ctx():
                opt.fused_backward(loss, LR)
    elif config in ("lomo", "lomo_clip", "adalomo", "lomo_accumulate", "lomo_accumulate_int8"):
        import lomo_kernels
        from lomo_kernels.ops import backends

        if config == "adalomo":
            family = backends.ADALOMO  # its own kernels
            opt = lomo_kernels.AdaLomo(model, lr=LR)
        else:
            family = backends.LOMO
            opt = lomo_kernels.Lomo(
                model,
                lr=LR,
                clip_grad_norm=1.0 if config == "lomo_clip" else None,
                accumulation_steps=ACCUMULATION_STEPS if "accumulate" in config else 1,
                accumulation_dtype=torch.int8 if config.endswith("_int8") else None,
            )
        # Loading the extension here keeps its code pages out of the measured steps.
        notes["backend"] = backends.backend_name(family.resolve(params[0].device, opt.backend))

        def step(ids: Any, labels: Any) -> None:
            # accumulation_steps micro-batches of this shape (one for the others).
            for _ in range(opt.accumulation_steps):
                loss = loss_of(ids, labels) / opt.accumulation_steps
                if opt.clip_grad_norm is not None:
                    opt.grad_norm(loss)
                opt.fused_backward(loss, LR)
    else:
        raise ValueError(f"unknown config {config!r}; choose from {', '.join(CONFIGS)}")
    return step, opt, notes


def _prepared(
    config: str, batch: int, seq: int, model: str, dtype: str, device: str, fused_head: bool
) -> tuple[Callable[[], None], Any, dict[str, Any]]:
    """`config`'s step on a fresh model and batch (seed 0), its optimizer and the run's facts."""
    import torch
    import transformers

    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    net = build_model(model, dtype, device, fused_head=fused_head)
    params = list(net.parameters())
    ids = torch.randint(0, net.config.vocab_size, (batch, seq), device=device)
    labels = ids.clone()
    facts: dict[str, Any] = {
        "config": config,
        "model": resolve_model(model).name,
        "dtype": dtype,
        "device": device,
        "batch": batch,
        "seq": seq,
        "fused_head": fused_head,
        "model_mb": sum(p.numel() * p.element_size() for p in params) / MIB,
        "num_parameters": sum(p.numel() for p in params),
        "largest_param_numel": max(p.numel() for p in params),
        "embedding_numel": net.get_input_embeddings().weight.numel(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "attn_implementation": net.config._attn_implementation,
    }
    step, opt, notes = make_step(config, net)
    facts.update(notes)
    return lambda: step(ids, labels), opt, facts


def measure(
    config: str,
    batch: int,
    seq: int,
    steps: int = 3,
    model: str = DEFAULT_MODEL,
    dtype: str = "bf16",
    device: str = "cpu",
    fused_head: bool = False,
) -> dict[str, Any]:
    """Runs `config` in this process and returns its figures (see the module docstring)."""
    if not device.startswith("cuda"):
        require_metered_process()
    if steps < 2:
        raise ValueError("steps must be >= 2: step 0 is not measured")
    step, opt, result = _prepared(config, batch, seq, model, dtype, device, fused_head)
    result["steps"] = steps
    meter = Meter(device)
    baseline = meter.current()
    peaks, transient = [], []
    for i in range(steps):
        start = meter.current()
        meter.reset_peak()
        step()
        if i > 0:
            peak = meter.peak()
            peaks.append(peak - baseline)
            transient.append(peak - start)
    result["baseline_mb"] = baseline / MIB
    result["peaks_mb"] = [p / MIB for p in peaks]
    result["peak_above_model_mb"] = max(peaks) / MIB
    # Compiled code and Inductor's caches stay resident after step 0; the step's own peak
    # is the rise above the memory at its start (equal to the above for eager runs).
    result["peak_above_step_start_mb"] = max(transient) / MIB
    # One more step, profiled (after the others: the profiler's own memory stays out of
    # the figures above): the peak of the tensors it allocates.
    result["tensor_peak_in_step_mb"] = tensor_balance(step, device)[0] / MIB
    result["state_mb"] = state_bytes(opt) / MIB
    if config in COMPILED:  # whether the backward ran as a compiled-autograd graph
        from torch._dynamo.utils import counters

        result["compiled_autograd_captures"] = int(counters["compiled_autograd"]["captures"])
    return result


def tensor_peaks(
    runs: Sequence[tuple[str, int, int]],
    model: str = DEFAULT_MODEL,
    dtype: str = "bf16",
    device: str = "cpu",
) -> list[dict[str, Any]]:
    """`measure`'s `tensor_peak_in_step_mb` and model facts for each (config, batch, seq) of
    `runs`, one after another in this process: each on its own model, its step 0 run
    unmeasured first. The profiler counts only the allocations of the profiled step, which
    do not depend on what ran before it in the process (unlike VmHWM), so one interpreter
    serves every run. Eager configurations only: Dynamo's caches would carry over."""
    import gc

    results = []
    for config, batch, seq in runs:
        if config in COMPILED:
            raise ValueError(f"{config}: a compiled configuration needs its own process")
        step, opt, facts = _prepared(config, batch, seq, model, dtype, device, False)
        step()  # step 0: lazy state, first-call allocations
        facts["tensor_peak_in_step_mb"] = tensor_balance(step, device)[0] / MIB
        results.append(facts)
        del step, opt
        gc.collect()  # the previous run's model, optimizer and hooks go before the next
    return results


def tensor_peaks_isolated(runs: Sequence[tuple[str, int, int]], **settings: Any) -> list[Any]:
    """`tensor_peaks` in one fresh interpreter; `settings`: its model, dtype and device."""
    arguments = {"runs": [list(run) for run in runs], **settings}
    return run_isolated(tensor_peaks, arguments, metered=False, timeout=TIMEOUT_S, what="peaks")


def measure_isolated(config: str, batch: int, seq: int, **settings: Any) -> dict[str, Any]:
    """`measure` in a fresh, metered interpreter; its figures. `settings`: the rest of
    measure's arguments (steps, model, dtype, device, fused_head)."""
    arguments = {"config": config, "batch": batch, "seq": seq, **settings}
    return run_isolated(measure, arguments, timeout=TIMEOUT_S, what=f"{config} {batch}x{seq}")


# -- the tables -------------------------------------------------------------------------------
def split_peaks(results: Sequence[dict[str, Any]], configs: Sequence[str]) -> list[dict[str, Any]]:
    """Per measured configuration of `configs` at one shape: the four parts of its peak
    (MiB), as the module docstring says; none without a `forward_graph` measurement."""
    graph = next((r for r in results if r["config"] == "forward_graph" and "error" not in r), {})
    if not graph:
        return []
    acts = graph["peak_above_model_mb"]
    out = []
    for r in results:
        if "error" in r or r["config"] not in configs:
            continue
        above = r["peak_above_model_mb"]
        states = r["state_mb"]
        out.append(
            {
                "config": r["config"],
                "label": SHORT.get(r["config"], r["config"]),
                "batch": r["batch"],
                "seq": r["seq"],
                "peak_mib": r["model_mb"] + above,
                "peak_above_model_mib": above,
                "parts_mib": {
                    "parameters": r["model_mb"],
                    "gradients": max(0.0, above - states - acts),
                    "optimizer_states": states,
                    "activations": min(acts, above - states),
                },
            }
        )
    return out


def format_table(split: Sequence[dict[str, Any]], meta: dict[str, Any]) -> str:
    """One shape's split: a row per configuration."""
    kind = "GPU (allocator peak)" if meta.get("gpu") else "CPU (VmHWM, MALLOC_MMAP_THRESHOLD_)"
    lines = [
        f"{meta['model']}: {meta['num_parameters'] / 1e6:.0f}M parameters, {meta['dtype']}, "
        f"batch {meta['batch']} x {meta['seq']}, attention {meta['attn_implementation']}; "
        f"{kind}; MiB",
        "| optimizer | peak | above the model | parameters | gradients + workspace | "
        "optimizer states | activations |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in split:
        p = s["parts_mib"]
        lines.append(
            f"| {s['label']} | {s['peak_mib']:.0f} | {s['peak_above_model_mib']:.0f} | "
            f"{p['parameters']:.0f} | {p['gradients']:.0f} | {p['optimizer_states']:.0f} | "
            f"{p['activations']:.0f} |"
        )
    return "\n".join(lines)


def format_shapes_table(
    raw: Sequence[dict[str, Any]], shapes: Sequence[tuple[int, int]], meta: dict[str, Any]
) -> str:
    """Configurations by shapes: the peak above the model (MiB), the model's size and the
    LOMO target at each shape."""
    peaks = {(r["config"], r["batch"], r["seq"]): r for r in raw if "error" not in r}
    columns = " | ".join(f"batch {b} x {s}" for b, s in shapes)
    lines = [
        f"peak above the model (MiB); lomo_kernels backend {meta.get('backend', '-')}, "
        f"{meta['steps']} steps (step 0 skipped)",
        f"| configuration | {columns} |",
        "|---|" + "---|" * len(shapes),
    ]
    for config in dict.fromkeys(r["config"] for r in raw):
        cells = [
            f"{peaks[key]['peak_above_model_mb']:.0f}" if key in peaks else "error"
            for key in ((config, b, s) for b, s in shapes)
        ]
        lines.append(f"| {LABELS[config]} | " + " | ".join(cells) + " |")
    gradient_mib = meta["largest_param_numel"] * DTYPES[meta["dtype"]].itemsize / MIB
    lines.append(
        f"\nModel weights: {meta['model_mb']:.0f} MiB; largest parameter "
        f"{meta['largest_param_numel'] / 1e6:.1f}M elements ({gradient_mib:.1f} MiB as a "
        f"{meta['dtype']} gradient)."
    )
    activations = [(b, s, peaks.get(("forward_graph", b, s))) for b, s in shapes]
    targets = [
        f"{b} x {s}: {(graph['peak_above_model_mb'] + gradient_mib) * TARGET_MARGIN:.0f} MiB"
        for b, s, graph in activations
        if graph is not None
    ]
    if targets:
        lines.append(
            f"LOMO target (activations + largest {meta['dtype']} gradient, +5%): "
            + ", ".join(targets)
            + "."
        )
    return "\n".join(lines)


# -- driver -----------------------------------------------------------------------------------
def run(
    model: str = DEFAULT_MODEL,
    shapes: Sequence[tuple[int, int]] = ((2, 256),),
    configs: Sequence[str] = OPTIMIZER_CONFIGS,
    steps: int = 3,
    dtype: str = "bf16",
    device: str = "cpu",
    progress: bool = True,
    fused_head: bool = False,
) -> tuple[list[dict[str, Any]], dict[str, Any], list[dict[str, Any]]]:
    """Every config plus `forward_graph`, at every shape, each in its own process:
    (split, meta, raw); a failed process's raw result holds its `error`."""
    todo = [(c, b, s) for b, s in shapes for c in dict.fromkeys(["forward_graph", *configs])]
    settings = {"steps": steps, "model": model, "dtype": dtype, "device": device}
    settings["fused_head"] = fused_head
    raw = []
    for config, batch, seq in with_progress(
        todo, progress, "bench memory", "process", name=lambda job: f"{job[0]} {job[1]}x{job[2]}"
    ):
        try:
            raw.append(measure_isolated(config, batch, seq, **settings))
        except (ProcessFailed, subprocess.TimeoutExpired) as exc:
            print(exc, file=sys.stderr)
            raw.append({"config": config, "batch": batch, "seq": seq, "error": str(exc)})
    split = [row for shape in shapes for row in split_peaks(at_shape(raw, shape), configs)]
    meta = machine.describe(device) | _model_facts(raw, shapes, steps)
    return split, meta, raw


def at_shape(rows: Sequence[dict[str, Any]], shape: tuple[int, int]) -> list[dict[str, Any]]:
    """The rows (results or split rows) measured at batch x seq `shape`."""
    return [r for r in rows if (r["batch"], r["seq"]) == tuple(shape)]


def _model_facts(
    raw: Sequence[dict[str, Any]], shapes: Sequence[tuple[int, int]], steps: int
) -> dict[str, Any]:
    """What every process measured alike (model, dtype, attention, threads, backend)."""
    first = next((r for r in raw if "error" not in r), None)
    if first is None:
        raise RuntimeError("every configuration failed:\n" + "\n".join(r["error"] for r in raw))
    alike = ("model", "num_parameters", "model_mb", "largest_param_numel", "dtype")
    alike += ("attn_implementation", "fused_head", "threads")
    backends = sorted({r["backend"] for r in raw if "backend" in r})
    batch, seq = shapes[0]  # the first shape's, for its table and plot
    return {k: first[k] for k in alike} | {
        "batch": batch,
        "seq": seq,
        "shapes": [list(shape) for shape in shapes],
        "steps": steps,
        "backend": ", ".join(backends) or "-",
    }


def shape_list(text: str) -> list[tuple[int, int]]:
    """'1x64,2x256' -> [(1, 64), (2, 256)]."""
    shapes = []
    for item in filter(None, (t.strip().lower() for t in text.split(","))):
        batch, _, seq = item.partition("x")
        if not (batch.isdigit() and seq.isdigit() and int(batch) > 0 and int(seq) > 0):
            raise argparse.ArgumentTypeError(f"got {item!r}: give batch x seq shapes, e.g. 1x64")
        shapes.append((int(batch), int(seq)))
    if not shapes:
        raise argparse.ArgumentTypeError(f"no shape in {text!r}: give e.g. 1x64,2x256")
    return shapes


def config_list(text: str) -> list[str]:
    """A comma list of configurations, or 'all' of them."""
    return list(CONFIGS) if text.strip().lower() == "all" else comma_list(CONFIGS, ALIASES)(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser, DEFAULT_MODEL)
    add_device_argument(parser)
    parser.add_argument("--dtype", default="bf16", choices=tuple(DTYPES))
    add_counts(parser, batch=2, seq=256)
    parser.add_argument(
        "--shapes",
        type=shape_list,
        default=None,
        help="several batch x seq shapes, e.g. 1x64,2x256 (instead of --batch and --seq; "
        "--plot draws the first)",
    )
    parser.add_argument(
        "--steps", type=whole_number(2), default=3, help="steps per process (step 0 skipped)"
    )
    parser.add_argument(
        "--optimizers",
        dest="configs",
        type=config_list,
        default="adamw,sgd,lomo_optim,lomo,adalomo",
        help=f"comma list of {', '.join(CONFIGS)}; or all",
    )
    add_fused_head_argument(parser)
    add_output_arguments(parser, "write the stacked bars (PNG) here")


def command(args: argparse.Namespace) -> int:
    shapes = args.shapes = args.shapes or [(args.batch, args.seq)]
    split, meta, raw = run(**keyword_arguments(args, run))
    tables = []
    for batch, seq in shapes:
        tables.append(
            format_table(at_shape(split, (batch, seq)), meta | {"batch": batch, "seq": seq})
        )
    if len(shapes) > 1:
        tables.append(format_shapes_table(raw, shapes, meta))
    failed = [f"{r['config']} {r['batch']}x{r['seq']}" for r in raw if "error" in r]
    if failed:
        tables.append("failed (error on stderr and in the JSON): " + ", ".join(failed))
    machine.print_results(meta, "\n\n".join(tables), args.json, split=split, raw=raw)
    if args.plot:
        from .common.plots import plot_memory

        plot_memory(at_shape(split, shapes[0]), meta, args.plot)
    return 1 if failed else 0


if __name__ == "__main__":
    from bench.common.cli import main

    sys.exit(main(__spec__.name))
