"""`make demo`: full-parameter fine-tuning of a small LLaMA with LOMO, AdaLomo and AdamW.

The same model (same initial weights) and the same batches for every optimizer, each run in
a process of its own (`tools/train_runner`, the runner of `bench train`): a progress bar,
the held-out loss before and after, and a closing table (with --plot, a PNG: loss curves,
peak memory split into what the optimizer holds and the rest, tokens/s). The data is the
generated corpus shipped with the package (lomo_kernels/data/corpus.txt: sentences about
small numbers, character level); 10% of its sentences are held out.

    python -m lomo_kernels.demo [--optimizers lomo,lomo_single,adalomo,adamw] [--steps N]
                                [--dtype bf16|fp16|fp32] [--size tiny|small|base|wide]
                                [--plot demo.png]

The default model ("wide": hidden 512, 2 layers, 128-character vocabulary, 6.6M
parameters) and batch (4 x 64 characters) are chosen so that what an optimizer holds is
most of the step's memory, as in fine-tuning a large model on short sequences: AdamW's
gradients and two fp32 moments are 3x the model, while LOMO holds one gradient at a time.
Peak memory is the process's VmHWM above what it holds once the model exists (CUDA: the
allocator's peak above the model), after a warm-up step. CPU timings are CPU timings, not
GPU figures; with one thread they are the process's CPU time, which other jobs on the machine
do not inflate (`train_runner.step_clock`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from .tools.argtypes import (
    Parser,
    comma_list,
    device,
    plot_path,
    positive_float,
    positive_int,
    whole_number,
)
from .tools.optimizers import DEFAULT_LR, HOLDS_ALL_GRADIENTS
from .tools.train_runner import Workload, run_isolated

WORKLOAD = "lomo_kernels.demo"  # this module by name: it also runs as __main__
CORPUS = Path(__file__).with_name("data") / "corpus.txt"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# (hidden, intermediate, layers, heads): parameter counts with the 128-character vocabulary.
SIZES = {
    "tiny": (128, 352, 4, 4),
    "small": (256, 688, 4, 4),
    "base": (384, 1024, 6, 6),
    "wide": (512, 1408, 2, 8),
}
CHOICES = ("lomo", "lomo_single", "adalomo", "adalomo_single", "adamw", "sgd")
DEFAULT_OPTIMIZERS = "lomo,lomo_single,adalomo,adamw"
BACKWARD_PASSES = {"lomo": 2, "adalomo": 2}  # exact clipping: a norm pass first; else 1
# Longest window: the model's position limit. Shortest: 2 characters, one next-character target.
MAX_SEQ = 512
MIN_SEQ = 2


def build_model(size: str, dtype: torch.dtype, seed: int, device: str = "cpu") -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, layers, heads = SIZES[size]
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=MAX_SEQ,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype: no fp32 copy left in the heap
    try:
        with torch.device(device):
            return LlamaForCausalLM(config).train()
    finally:
        torch.set_default_dtype(previous)


def load_corpus() -> tuple[torch.Tensor, torch.Tensor]:
    """Character ids of the training and held-out sentences (the last 10%)."""
    lines = CORPUS.read_text().splitlines()
    cut = len(lines) * 9 // 10

    def ids(part: list[str]) -> torch.Tensor:
        return torch.tensor([min(ord(c), 127) for c in "\n".join(part) + "\n"])

    return ids(lines[:cut]), ids(lines[cut:])


def windows(data: torch.Tensor, seq: int, batch: int, seed: int):
    """Endless batches of random windows of `data`."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen)
        yield torch.stack([data[s : s + seq] for s in starts.tolist()])


def held_out_loss(model: torch.nn.Module, data: torch.Tensor, seq: int, device: str) -> float:
    """Mean loss over consecutive windows covering the whole held-out text."""
    n = (data.numel() - 1) // seq
    ids = data[: n * seq].view(n, seq).to(device)
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


def build(spec: dict[str, Any]) -> Workload:
    """The demo's workload in one optimizer's process (called by `train_runner`)."""
    train_ids, held_ids = load_corpus()
    device = spec["device"]
    model = build_model(spec["size"], DTYPES[spec["dtype"]], spec["seed"], device)

    def cosine_schedule(opt: Any) -> Any:
        # eta_min: a tenth of the lr.
        lr = opt.param_groups[0]["lr"]
        return torch.optim.lr_scheduler.CosineAnnealingLR(
            opt, T_max=spec["steps"], eta_min=lr * 0.1
        )

    return Workload(
        model,
        windows(train_ids, spec["seq"], spec["batch"], spec["seed"]),
        evaluate=lambda: held_out_loss(model, held_ids, spec["seq"], device),
        make_scheduler=cosine_schedule,
    )


def _held_mib(r: dict[str, Any]) -> float:
    """What the optimizer holds at its step's peak: its state, and every gradient for the
    optimizers that keep them all (LOMO-style ones free each gradient in backward)."""
    grads = r["model_mib"] if r["optimizer"] in HOLDS_ALL_GRADIENTS else 0.0
    return r["state_mib"] + grads


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| optimizer | backward passes | lr | held-out loss before -> after | tokens/s | "
        "median step | peak above model (MiB) | of which state + all gradients (MiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['optimizer']} | {BACKWARD_PASSES.get(r['optimizer'], 1)} | {r['lr']:g} | "
            f"{r['loss_before']:.3f} -> {r['loss_after']:.3f} | {r['tokens_per_s']:,.0f} | "
            f"{r['median_step_s'] * 1e3:.0f} ms | {r['peak_above_model_mib']:.0f} | "
            f"{_held_mib(r):.0f} |"
        )
    return "\n".join(lines)


def verdict(results: list[dict[str, Any]]) -> str:
    """The trade-off in words: each optimizer's peak and speed against AdamW's."""
    by_name = {r["optimizer"]: r for r in results}
    base = by_name.get("adamw")
    if base is None:
        return ""
    peak = base["peak_above_model_mib"]
    lines = [
        f"AdamW holds {_held_mib(base):.0f} MiB of gradients and moments at its peak: "
        f"{_held_mib(base) / peak:.0%} of its {peak:.0f} MiB above the model. LOMO and AdaLomo "
        "hold one gradient at a time and (AdaLomo) factored moments:"
    ]
    for r in results:
        if r is base:
            continue
        lines.append(
            f"  {r['optimizer']}: peak {r['peak_above_model_mib'] / peak:.2f}x "
            f"AdamW's, {r['tokens_per_s'] / base['tokens_per_s']:.2f}x its tokens/s, "
            f"held-out loss {r['loss_after']:.2f} (AdamW {base['loss_after']:.2f})"
        )
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: str, title: str) -> None:
    from .tools.plots import _pyplot

    plt = _pyplot()
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(14, 4.2), width_ratios=(2, 1.2, 1))
    for r in results:
        a.plot(r["losses"], lw=0.8, label=f"{r['optimizer']} (held-out {r['loss_after']:.2f})")
    a.set_xlabel("step")
    a.set_ylabel("training loss")
    a.legend(fontsize=8)
    a.grid(alpha=0.3)
    names = [r["optimizer"] for r in results]
    held = [_held_mib(r) for r in results]
    rest = [r["peak_above_model_mib"] - h for r, h in zip(results, held, strict=True)]
    b.bar(names, rest, color="#55a868", label="activations and workspace")
    b.bar(names, held, bottom=rest, color="#c44e52", label="gradients + optimizer state")
    b.set_ylabel("peak above the model (MiB, lower is better)")
    b.legend(fontsize=7)
    c.bar(names, [r["tokens_per_s"] for r in results], color="#4c72b0")
    c.set_ylabel("tokens/s (higher is better)")
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
        choices=list(DTYPES),
        default=None,
        help="default: bf16 where bf16 matmuls are native (GPUs, CPUs with AVX-512 BF16 or AMX), "
        "else fp32 (torch emulates bf16 matmuls about 40x slower there)",
    )
    parser.add_argument("--steps", type=positive_int, default=60)
    parser.add_argument("--batch", type=positive_int, default=4)
    parser.add_argument("--seq", type=whole_number(MIN_SEQ, MAX_SEQ), default=64)
    parser.add_argument("--lr", type=positive_float, default=None, help="default per optimizer")
    parser.add_argument("--clip-grad-norm", type=positive_float, default=1.0)
    parser.add_argument("--device", type=device, default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--threads", type=positive_int, default=1, help="CPU threads (1: shared 2-core machines)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", type=plot_path, default=None, help="write the PNG here")


def banner(args: argparse.Namespace, dtype_reason: str) -> str:
    from lomo_kernels.ops import backends

    hidden, inter, layers, heads = SIZES[args.size]
    model = build_model(args.size, torch.float32, 0, "meta")
    n_params = sum(p.numel() for p in model.parameters())
    backend = backends.backend_name(backends.resolve(torch.device(args.device)))
    return (
        f"LLaMA architecture: {n_params / 1e6:.1f}M parameters (hidden {hidden}, {layers} "
        f"layers), {args.device}, {args.steps} steps of {args.batch} x {args.seq} characters "
        f"per optimizer, each in its own process; Lomo kernels: {backend} backend\n"
        f"dtype {args.dtype}: {dtype_reason}"
    )


def dtype_choice(args: argparse.Namespace) -> str:
    """Sets args.dtype when not given; the reason for the choice, for the banner."""
    from .tools import machine

    if args.dtype is not None:
        return "chosen with --dtype"
    args.dtype = machine.fast_dtype(args.device)
    if args.device.startswith("cuda"):
        return "the GPU multiplies bf16 natively"
    if args.dtype == "fp32":
        return (
            "this CPU has no native bf16 matmul (no AVX-512 BF16, no AMX), where torch "
            "emulates bf16 matmuls about 40x slower than fp32 (--dtype bf16 to force it)"
        )
    return f"this CPU multiplies bf16 natively ({machine.vector_isa()})"


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Train with each optimizer, print the table (and write the plot); the results."""
    from .tools import machine

    torch.set_num_threads(args.threads)
    print(banner(args, dtype_choice(args)), flush=True)
    spec = {key: getattr(args, key) for key in ("size", "dtype", "device", "batch", "seq", "steps")}
    spec["seed"] = args.seed
    results = [
        run_isolated(
            WORKLOAD,
            spec,
            name,
            steps=args.steps,
            lr=DEFAULT_LR[name] if args.lr is None else args.lr,
            clip_grad_norm=args.clip_grad_norm,
            threads=args.threads,
            progress=True,
        )
        for name in args.optimizers
    ]
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
                f"{r['optimizer']}: the held-out loss did not fall: something is wrong"
            )
    return results


def command(args: argparse.Namespace) -> int:
    """The exit status of a demo run (`lomo-kernels demo`)."""
    run(args)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = Parser(
        prog="python -m lomo_kernels.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return command(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
