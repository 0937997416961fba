"""Peak memory of one training step per optimizer, split like the LOMO paper's Figure 2.

    lomo-kernels bench memory --model llama-168m [--device cpu|cuda] [--batch B --seq S]
                              [--optimizers adamw,sgd,lomo_optim,lomo,adalomo]
                              [--json F] [--plot F.png]

Each configuration runs in a fresh process (`run_isolated`).
CPU (MEASURING.md): the process starts with MALLOC_MMAP_THRESHOLD_=65536, so
every block >= 64 KiB is mmapped and returned on free; the model is built directly in its
dtype; the baseline is VmRSS once the model, the inputs and the optimizer exist; before each
step "5" is written to /proc/self/clear_refs (resets VmHWM) and VmHWM is read after it.
CUDA: the caching allocator's statistics, `memory_allocated()` as the baseline and
`max_memory_allocated()` after `reset_peak_memory_stats()` for each step.
Both: step 0 is not measured (lazy state, first-call allocations); the figure is the max over
the following steps. MiB = 2**20 bytes.

The split of a peak (stacked bars): parameters = the model's bytes; optimizer states = the
bytes of the optimizer's state tensors after the run; activations = the peak of a forward
pass keeping its graph (config `forward_graph`, its own process, same batch); gradients =
the rest of the peak (peak above the model - states - activations, at least 0). That last
part also holds each optimizer's transient workspace (e.g. lomo-optim's fp32 copies), and
where the peak falls inside backward before the gradients exist it is small: it is a
measured remainder, not a count of gradient tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .argtypes import (
    add_output_arguments,
    comma_list,
    device,
    model_name,
    positive_int,
    whole_number,
)
from .models import PRESETS, resolve_model
from .optimizers import state_bytes

MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"
MMAP_VALUE = "65536"
THREADS = 2
LR = 1e-3
MIB = 2**20
DEFAULT_MODEL = "llama-168m"

CONFIGS = (
    "forward_nograd",
    "forward_graph",
    "sgd",
    "adamw",
    "official_lomo",
    "lomo",
    "lomo_clip",
    "adalomo",
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
    "lomo_compiled_forward": "Lomo, compiled fwd",
    "lomo_compiled_autograd": "Lomo, compiled fwd + CA",
    "lomo_compiled_layers": "Lomo, compiled layers",
}
DTYPES = ("bf16", "fp16", "fp32")


# -- readings -------------------------------------------------------------------------------
def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def rss_bytes() -> int:
    return _status_kb("VmRSS") * 1024


def hwm_bytes() -> int:
    return _status_kb("VmHWM") * 1024


def reset_hwm() -> None:
    # "5" resets the peak RSS (VmHWM) to the current RSS (Linux >= 4.0).
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class Meter:
    """Baseline and per-step peak in bytes: /proc on CPU, the allocator on CUDA."""

    def __init__(self, device: str) -> None:
        import torch

        self.torch = torch
        self.cuda = device.startswith("cuda")
        # The statistics of `device` itself (cuda:N), not of the current device.
        self.device = device

    def current(self) -> int:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)
            return self.torch.cuda.memory_allocated(self.device)
        return rss_bytes()

    def reset_peak(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)
            self.torch.cuda.reset_peak_memory_stats(self.device)
        else:
            reset_hwm()

    def peak(self) -> int:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)
            return self.torch.cuda.max_memory_allocated(self.device)
        return hwm_bytes()


def tensor_balance(run: Callable[[], None], device: str) -> tuple[int, int]:
    """(peak, end) in bytes of the tensors allocated while `run` runs, above what was
    allocated when it started: every allocation and free on `device` as the profiler's
    allocator events record them, those of compiled code included.

    The analogue on CPU of the CUDA allocator's peak statistics: tensor memory only, not
    the rest of the process (code, Python objects), which VmHWM also counts. `end` is what
    `run` left allocated (lazy state, constants a compiler keeps).
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, profile_memory=True) as prof:
        run()
        if cuda:
            torch.cuda.synchronize(device)
    events = sorted(
        (
            e
            for e in prof.profiler.kineto_results.events()
            if e.name() == "[memory]" and e.device_type() == kind
        ),
        key=lambda e: e.start_ns(),
    )
    current = peak = 0
    for event in events:
        current += event.nbytes()
        peak = max(peak, current)
    return peak, current


# -- the model and one step -----------------------------------------------------------------
def build_model(
    model: str, dtype: str = "bf16", device: str = "cpu", fused_head: bool = False
) -> Any:
    """A LlamaForCausalLM of `model`'s shape, created directly in `dtype` on `device`;
    `fused_head`: its loss made logits-free (`lomo_kernels.patch_causal_lm`).

    An fp32 model cast afterwards would leave its freed fp32 pages in the baseline.
    """
    import torch
    from transformers import LlamaForCausalLM

    config = resolve_model(model).to_hf_config()
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)
    try:
        with torch.device(device):
            net = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    assert all(p.dtype == torch_dtype for p in net.parameters())
    if fused_head:
        from ..integrations.causal_lm import patch_causal_lm

        patch_causal_lm(net)
    return net.train()


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

        from torch._dynamo import compiled_autograd

        import lomo_kernels

        opt = lomo_kernels.Lomo(model, lr=LR)
        if config == "lomo_compiled_layers":
            for layer in model.model.layers:
                layer.compile()  # in place; autograd runs eagerly between the layers
            forward = model
        else:
            forward = torch.compile(model)
        backward_ctx = (
            (lambda: compiled_autograd._enable(torch.compile(backend="inductor")))
            if config == "lomo_compiled_autograd"
            else contextlib.nullcontext
        )

        def step(ids: Any, labels: Any) -> None:
            loss = forward(input_ids=ids, labels=labels).loss
            with backward_ctx():
                opt.fused_backward(loss, LR)
    elif config in ("lomo", "lomo_clip", "adalomo"):
        import lomo_kernels
        from lomo_kernels.ops import backends

        if config == "adalomo":
            family = backends.ADALOMO  # its own kernels
            opt = lomo_kernels.AdaLomo(model, lr=LR)
        else:
            family = backends.LOMO
            opt = lomo_kernels.Lomo(
                model, lr=LR, clip_grad_norm=1.0 if config == "lomo_clip" else None
            )
        # Loading the extension here keeps its code pages out of the measured steps.
        notes["backend"] = backends.backend_name(family.resolve(params[0].device, opt.backend))

        def step(ids: Any, labels: Any) -> None:
            loss = loss_of(ids, labels)
            if opt.clip_grad_norm is not None:
                opt.grad_norm(loss)
            opt.fused_backward(loss, LR)
    else:
        raise ValueError(f"unknown config {config!r}; choose from {', '.join(CONFIGS)}")
    return step, opt, notes


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
    cuda = device.startswith("cuda")
    if not cuda and os.environ.get(MMAP_ENV) != MMAP_VALUE:
        raise RuntimeError(f"{MMAP_ENV}={MMAP_VALUE} must be set before the process starts")
    if steps < 2:
        raise ValueError("steps must be >= 2: step 0 is not measured")
    import torch
    import transformers

    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    net = build_model(model, dtype, device, fused_head)
    params = list(net.parameters())
    ids = torch.randint(0, net.config.vocab_size, (batch, seq), device=device)
    labels = ids.clone()
    result: dict[str, Any] = {
        "config": config,
        "model": resolve_model(model).name,
        "dtype": dtype,
        "device": device,
        "batch": batch,
        "seq": seq,
        "steps": steps,
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
    result.update(notes)
    meter = Meter(device)
    baseline = meter.current()
    peaks, transient = [], []
    for i in range(steps):
        start = meter.current()
        meter.reset_peak()
        step(ids, labels)
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
    tensor_peak, _ = tensor_balance(lambda: step(ids, labels), device)
    result["tensor_peak_in_step_mb"] = tensor_peak / MIB
    result["state_mb"] = state_bytes(opt) / MIB
    return result


# -- driver ---------------------------------------------------------------------------------
def child_env(metered: bool = True) -> dict[str, str]:
    """The environment of a measuring process: the malloc setting (`metered`: its peak
    memory is read; the setting slows every large allocation), and this package first."""
    env = dict(os.environ)
    if metered:
        env[MMAP_ENV] = MMAP_VALUE
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


def run_isolated(
    config: str,
    batch: int,
    seq: int,
    steps: int = 3,
    timeout: float | None = 900,
    model: str = DEFAULT_MODEL,
    dtype: str = "bf16",
    device: str = "cpu",
    fused_head: bool = False,
) -> dict[str, Any]:
    """`measure` in a fresh interpreter started with the malloc setting; its JSON result."""
    cmd = [sys.executable, "-m", "lomo_kernels.tools.bench_memory", config, "--model", model]
    cmd += ["--batch", str(batch), "--seq", str(seq), "--steps", str(steps), "--dtype", dtype]
    cmd += ["--device", device] + (["--fused-head"] if fused_head else [])
    proc = subprocess.run(
        cmd, env=child_env(), capture_output=True, text=True, timeout=timeout, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"{config} {batch}x{seq} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def split_peaks(results: dict[str, dict[str, Any]], configs: Sequence[str]) -> list[dict[str, Any]]:
    """Per optimizer config: the four parts of its peak (MiB), as the module docstring says."""
    acts = results["forward_graph"]["peak_above_model_mb"]
    out = []
    for config in configs:
        r = results[config]
        above = r["peak_above_model_mb"]
        states = r["state_mb"]
        rest = max(0.0, above - states - acts)
        out.append(
            {
                "config": config,
                "label": SHORT.get(config, config),
                "peak_mib": r["model_mb"] + above,
                "peak_above_model_mib": above,
                "parts_mib": {
                    "parameters": r["model_mb"],
                    "gradients": rest,
                    "optimizer_states": states,
                    "activations": min(acts, above - states),
                },
            }
        )
    return out


def format_table(split: Sequence[dict[str, Any]], meta: dict[str, Any]) -> str:
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


def run(
    model: str = DEFAULT_MODEL,
    batch: int = 2,
    seq: int = 256,
    configs: Sequence[str] = OPTIMIZER_CONFIGS,
    steps: int = 3,
    dtype: str = "bf16",
    device: str = "cpu",
    progress: bool = True,
    fused_head: bool = False,
) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, dict[str, Any]]]:
    """Every config plus `forward_graph`, each in its own process: (split, meta, raw)."""
    from . import machine

    todo = ["forward_graph", *configs]
    it: Any = todo
    if progress:
        from tqdm import tqdm

        it = tqdm(todo, desc="bench memory", unit="process")
    raw = {}
    for config in it:
        if hasattr(it, "set_postfix_str"):
            it.set_postfix_str(config)
        raw[config] = run_isolated(
            config, batch, seq, steps, model=model, dtype=dtype, device=device,
            fused_head=fused_head,
        )  # fmt: skip
    first = raw["forward_graph"]
    meta = machine.describe(device) | {
        k: first[k]
        for k in (
            "model",
            "num_parameters",
            "dtype",
            "batch",
            "seq",
            "attn_implementation",
            "fused_head",
        )  # fmt: skip
    }
    meta["largest_param_numel"] = first["largest_param_numel"]
    meta["threads"] = first["threads"]
    return split_peaks(raw, configs), meta, raw


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        type=model_name,
        default=DEFAULT_MODEL,
        help=f"{', '.join(PRESETS)} or a HF config.json path",
    )
    parser.add_argument("--device", type=device, default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--dtype", default="bf16", choices=DTYPES)
    parser.add_argument("--batch", type=positive_int, default=2)
    parser.add_argument("--seq", type=positive_int, default=256)
    parser.add_argument(
        "--steps", type=whole_number(2), default=3, help="steps per process (step 0 skipped)"
    )
    parser.add_argument(
        "--optimizers",
        type=comma_list(CONFIGS, ALIASES),
        default="adamw,sgd,lomo_optim,lomo,adalomo",
        help="comma list",
    )
    add_fused_head_argument(parser)
    add_output_arguments(parser, "write the stacked bars (PNG) here")


def add_fused_head_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--fused-head",
        action="store_true",
        help="the logits-free loss of lomo_kernels.patch_causal_lm (no [tokens x vocab] tensors)",
    )


def command(args: argparse.Namespace) -> int:
    split, meta, raw = run(
        args.model,
        args.batch,
        args.seq,
        args.optimizers,
        args.steps,
        args.dtype,
        args.device,
        progress=not args.no_progress,
        fused_head=args.fused_head,
    )
    from . import machine

    machine.print_results(meta, format_table(split, meta), args.json, split=split, raw=raw)
    if args.plot:
        from .plots import plot_memory

        plot_memory(split, meta, args.plot)
    return 0


def _child_main(argv: Sequence[str] | None = None) -> None:
    """One configuration in this process (started by `run_isolated`); prints one JSON line."""
    parser = argparse.ArgumentParser(description="one memory measurement (internal)")
    parser.add_argument("config", choices=CONFIGS)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dtype", default="bf16", choices=DTYPES)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--fused-head", action="store_true")
    a = parser.parse_args(argv)
    result = measure(a.config, a.batch, a.seq, a.steps, a.model, a.dtype, a.device, a.fused_head)
    print(json.dumps(result))


if __name__ == "__main__":
    _child_main()
