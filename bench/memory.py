"""Peak host memory of one training step on CPU, per optimizer (method: MEASURING.md).

    python bench/memory.py CONFIG --batch B --seq S [--steps N] [--json]
    python bench/memory.py --all [--batch B --seq S] [--json-out PATH]

One configuration per process: glibc only returns freed memory to the system when large
blocks are mmapped, so MALLOC_MMAP_THRESHOLD_=65536 must be in the environment before the
process starts (the script re-executes itself with it). The baseline is VmRSS once the bf16
model, the inputs and the optimizer exist; before each step "5" is written to
/proc/self/clear_refs (resets VmHWM) and VmHWM is read after it. Step 0 is skipped (lazy
state, first-call allocations); the figure is the max over steps 1..N-1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"
MMAP_VALUE = "65536"
THREADS = 2
LR = 1e-3
MB = 2**20  # MiB, the unit of the figures in MEASURING.md

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
)
DEFAULT_SHAPES = ((1, 64), (2, 256))

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
}
COMPILED = ("lomo_compiled_forward", "lomo_compiled_autograd")


# -- /proc readings -------------------------------------------------------------------------
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


# -- the model ------------------------------------------------------------------------------
MODELS = {
    # The ~168M-parameter LLaMA of MEASURING.md.
    "168m": {"hidden": 1024, "intermediate": 2816, "layers": 8, "heads": 16, "vocab": 32000},
    # A light one for the tests (~6M parameters).
    "small": {"hidden": 256, "intermediate": 704, "layers": 2, "heads": 4, "vocab": 8000},
}


def build_model(size: str = "168m") -> Any:
    """A LLaMA-architecture model of MODELS, created directly in bf16."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    m = MODELS[size]
    config = LlamaConfig(
        hidden_size=m["hidden"],
        intermediate_size=m["intermediate"],
        num_hidden_layers=m["layers"],
        num_attention_heads=m["heads"],
        num_key_value_heads=m["heads"],
        vocab_size=m["vocab"],
        tie_word_embeddings=False,
    )
    # An fp32 model cast afterwards would leave its freed fp32 pages in the baseline.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    return model.train()


def make_step(config: str, model: Any) -> tuple[Callable[[Any, Any], None], dict[str, Any]]:
    """The per-step function of `config` (optimizer built here) and notes for the report."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    notes: dict[str, Any] = {}

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

        official = lomo_optim.Lomo(model, lr=LR)

        def step(ids: Any, labels: Any) -> None:
            official.fused_backward(loss_of(ids, labels), LR)
    elif config in COMPILED:
        from torch._dynamo import compiled_autograd

        import lomo_kernels

        ours = lomo_kernels.Lomo(model, lr=LR)
        forward = torch.compile(model)
        backward_ctx = (
            (lambda: compiled_autograd._enable(torch.compile(backend="inductor")))
            if config == "lomo_compiled_autograd"
            else contextlib.nullcontext
        )

        def step(ids: Any, labels: Any) -> None:
            loss = forward(input_ids=ids, labels=labels).loss
            with backward_ctx():
                ours.fused_backward(loss, LR)
    elif config in ("lomo", "lomo_clip", "adalomo"):
        import lomo_kernels
        from lomo_kernels import backends

        if config == "adalomo":
            from lomo_kernels import adalomo_backends as backends  # its own kernels

            ours = lomo_kernels.AdaLomo(model, lr=LR)
        else:
            ours = lomo_kernels.Lomo(
                model, lr=LR, clip_grad_norm=1.0 if config == "lomo_clip" else None
            )
        # Loading the extension here keeps its code pages out of the measured steps.
        notes["backend"] = backends.backend_name(backends.resolve(params[0].device, ours.backend))

        def step(ids: Any, labels: Any) -> None:
            loss = loss_of(ids, labels)
            if ours.clip_grad_norm is not None:
                ours.grad_norm(loss)
            ours.fused_backward(loss, LR)
    else:
        raise ValueError(f"unknown config {config!r}; choose from {', '.join(CONFIGS)}")
    return step, notes


def measure(
    config: str, batch: int, seq: int, steps: int = 3, model_size: str = "168m"
) -> dict[str, Any]:
    """Runs `config` in this process and returns its figures (see the module docstring)."""
    if os.environ.get(MMAP_ENV) != MMAP_VALUE:
        raise RuntimeError(f"{MMAP_ENV}={MMAP_VALUE} must be set before the process starts")
    if steps < 2:
        raise ValueError("steps must be >= 2: step 0 is not measured")
    import torch
    import transformers

    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    model = build_model(model_size)
    params = list(model.parameters())
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq))
    labels = ids.clone()
    result: dict[str, Any] = {
        "config": config,
        "batch": batch,
        "seq": seq,
        "steps": steps,
        "model_mb": sum(p.numel() * p.element_size() for p in params) / MB,
        "largest_param_numel": max(p.numel() for p in params),
        "embedding_numel": model.get_input_embeddings().weight.numel(),
        "model_size": model_size,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "attn_implementation": model.config._attn_implementation,
    }
    step, notes = make_step(config, model)
    result.update(notes)
    baseline = rss_bytes()
    peaks, transient = [], []
    for i in range(steps):
        start = rss_bytes()
        reset_hwm()
        step(ids, labels)
        if i > 0:
            peaks.append(hwm_bytes() - baseline)
            transient.append(hwm_bytes() - start)
    result["baseline_mb"] = baseline / MB
    result["peaks_mb"] = [p / MB for p in peaks]
    result["peak_above_model_mb"] = max(peaks) / MB
    # Compiled code and Inductor's caches stay resident after step 0; the step's own peak
    # is the rise above the RSS at its start (equal to the above for eager runs).
    result["peak_above_step_start_mb"] = max(transient) / MB
    return result


# -- driver ---------------------------------------------------------------------------------
def mmap_env() -> dict[str, str]:
    env = dict(os.environ)
    env[MMAP_ENV] = MMAP_VALUE
    return env


def run_isolated(
    config: str,
    batch: int,
    seq: int,
    steps: int = 3,
    timeout: float | None = 900,
    model_size: str = "168m",
) -> dict[str, Any]:
    """`measure` in a fresh interpreter started with the malloc setting; its JSON result."""
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        config,
        "--batch",
        str(batch),
        "--seq",
        str(seq),
        "--steps",
        str(steps),
        "--model",
        model_size,
        "--json",
    ]
    proc = subprocess.run(
        cmd, env=mmap_env(), capture_output=True, text=True, timeout=timeout, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"{config} {batch}x{seq} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def machine_line(results: Sequence[dict[str, Any]]) -> str:
    first = next(iter(results), {})
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    backends = sorted({r["backend"] for r in results if "backend" in r})
    return (
        f"CPU: {cpu}, {os.cpu_count()} cores; threads {first.get('threads')}; "
        f"torch {first.get('torch')}; transformers {first.get('transformers')}; "
        f"attention {first.get('attn_implementation')}; lomo_kernels backend "
        f"{', '.join(backends) or '-'}; {MMAP_ENV}={MMAP_VALUE}; steps "
        f"{first.get('steps')} (step 0 skipped)"
    )


def markdown_table(results: Sequence[dict[str, Any]], shapes: Sequence[tuple[int, int]]) -> str:
    """Rows = configs, columns = batch shapes, cells = peak above the model (MB)."""
    by_key = {(r["config"], r["batch"], r["seq"]): r for r in results}
    head = (
        "| configuration | "
        + " | ".join(f"batch {b} x {s}: peak above model (MB)" for b, s in shapes)
        + " |"
    )
    lines = [head, "|---|" + "---|" * len(shapes)]
    for config in CONFIGS:
        cells = []
        for b, s in shapes:
            r = by_key.get((config, b, s))
            if r is None:
                cells.append("")
            elif "error" in r:
                cells.append("error")
            else:
                cells.append(f"{r['peak_above_model_mb']:.0f}")
        lines.append(f"| {LABELS[config]} | " + " | ".join(cells) + " |")
    any_r = next((r for r in results if "model_mb" in r), None)
    if any_r is not None:
        largest = any_r["largest_param_numel"]
        lines.append("")
        lines.append(
            f"Model weights: {any_r['model_mb']:.0f} MB; largest parameter "
            f"{largest / 1e6:.1f}M elements ({largest * 2 / MB:.1f} MB as a bf16 "
            "gradient); MB = 2**20 bytes."
        )
        budgets = []
        for b, s in shapes:
            graph = by_key.get(("forward_graph", b, s), {}).get("peak_above_model_mb")
            if graph is not None:
                # The LOMO target: activations plus one gradient of the largest tensor, +5%.
                budgets.append(f"{b} x {s}: {(graph + largest * 2 / MB) * 1.05:.0f} MB")
        if budgets:
            lines.append(
                "LOMO target (activations + largest bf16 gradient, +5%): "
                + ", ".join(budgets)
                + "."
            )
    return "\n".join(lines)


def run_all(
    shapes: Sequence[tuple[int, int]], steps: int = 3, configs: Sequence[str] = CONFIGS
) -> list[dict[str, Any]]:
    results = []
    for config in configs:
        for batch, seq in shapes:
            try:
                r = run_isolated(config, batch, seq, steps)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                r = {"config": config, "batch": batch, "seq": seq, "error": str(exc)}
                print(r["error"], file=sys.stderr)
            results.append(r)
            print(
                f"{config} {batch}x{seq}: {r.get('peak_above_model_mb', 'error')}",
                file=sys.stderr,
                flush=True,
            )
    return results


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", choices=CONFIGS)
    parser.add_argument("--all", action="store_true", help="every config, fresh processes")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--model", choices=tuple(MODELS), default="168m")
    parser.add_argument("--json", action="store_true", help="one line of JSON")
    parser.add_argument("--json-out", default=None, help="--all: write the results here")
    args = parser.parse_args(argv)

    if args.all:
        if (args.batch is None) != (args.seq is None):
            parser.error("give both --batch and --seq, or neither")
        shapes = DEFAULT_SHAPES if args.batch is None else ((args.batch, args.seq),)
        results = run_all(shapes, args.steps)
        print(machine_line(results))
        print()
        print(markdown_table(results, shapes))
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(results, f, indent=1)
        return
    if args.config is None:
        parser.error("give a CONFIG or --all")
    if os.environ.get(MMAP_ENV) != MMAP_VALUE:
        # glibc reads the threshold at start-up: restart with it in the environment.
        os.execve(
            sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]], mmap_env()
        )
    assert os.environ.get(MMAP_ENV) == MMAP_VALUE
    batch = 2 if args.batch is None else args.batch
    seq = 256 if args.seq is None else args.seq
    result = measure(args.config, batch, seq, args.steps, args.model)
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
