"""`make demo`: full-parameter fine-tuning of a small LLaMA, with Lomo and with AdamW.

The same model (same initial weights) and the same batches, once per optimizer, side by
side: a progress bar (loss, tokens/s, peak memory), the held-out loss before and after, and
a closing table (and, with --plot, a PNG: loss curves, peak memory, step time). The data is
the generated corpus shipped with the package (lomo_kernels/data/corpus.txt: sentences about
small numbers, character level); 10% of its sentences are held out.

    python -m lomo_kernels.demo [--optimizers lomo,adamw] [--steps N] [--dtype bf16|fp16|fp32]
                                [--size tiny|small|base] [--plot demo.png]

Peak memory is how far one step raises the process above what it holds before the step
(VmHWM on CPU after handing freed pages back with malloc_trim; the allocator's peak on
CUDA): gradients, activations and workspace; optimizer states exist from the first step on
and are shown apart. Step 0 is not counted. CPU timings are CPU timings, not GPU figures.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

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

CORPUS = Path(__file__).with_name("data") / "corpus.txt"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# (hidden, intermediate, layers, heads): parameter counts with the 128-character vocabulary.
SIZES = {"tiny": (128, 352, 4, 4), "small": (256, 688, 4, 4), "base": (384, 1024, 6, 6)}
OPTIMIZERS = ("lomo", "adalomo", "adamw", "sgd")
DEFAULT_LR = {"lomo": 0.3, "adalomo": 0.02, "adamw": 2e-3, "sgd": 0.3}
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
    return LlamaForCausalLM(config).to(device=device, dtype=dtype).train()


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


class PeakMeter:
    """Peak bytes of one step above the level before it.

    CPU (Linux): glibc keeps freed memory, so first `malloc_trim(0)` hands every free page
    back to the system, then VmHWM is reset ("5" into /proc/self/clear_refs) and read after
    the step. CUDA: the allocator's peak statistics.
    """

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.linux = sys.platform.startswith("linux")
        self.base = 0
        self._trim = None
        if self.linux and not self.cuda:
            try:
                self._trim = ctypes.CDLL("libc.so.6").malloc_trim
            except OSError:
                self._trim = None

    @staticmethod
    def _status(field: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        return 0

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        elif self.linux:
            if self._trim is not None:
                self._trim(0)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.base = self._status("VmRSS")

    def peak(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        return self._status("VmHWM") - self.base if self.linux else 0


@dataclass
class Result:
    optimizer: str
    lr: float
    loss_before: float
    loss_after: float = float("nan")
    losses: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    peak_mib: float = 0.0
    tokens_per_s: float = 0.0


def make_optimizer(name: str, model: torch.nn.Module, lr: float, clip: float | None, steps: int):
    """The optimizer and a step function taking the loss (lr schedule included)."""
    from lomo_kernels import AdaLomo, Lomo

    if name in ("lomo", "adalomo"):
        cls = Lomo if name == "lomo" else AdaLomo
        opt = cls(model, lr=lr, clip_grad_norm=clip)

        def step(loss: torch.Tensor) -> None:
            opt.fused_backward(loss)
            sched.step()
    else:
        params = model.parameters()
        opt = (
            torch.optim.AdamW(params, lr=lr) if name == "adamw" else torch.optim.SGD(params, lr=lr)
        )

        def step(loss: torch.Tensor) -> None:
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()

    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps, eta_min=lr * 0.1)
    return opt, step


def train(name: str, args: argparse.Namespace, device: str) -> Result:
    from tqdm import tqdm

    train_ids, held_ids = load_corpus()
    model = build_model(args.size, DTYPES[args.dtype], args.seed, device)
    lr = DEFAULT_LR[name] if args.lr is None else args.lr
    result = Result(name, lr, held_out_loss(model, held_ids, args.seq, device))
    opt, step = make_optimizer(name, model, lr, args.clip_grad_norm, args.steps)
    data = windows(train_ids, args.seq, args.batch, args.seed)
    meter = PeakMeter(device)
    tokens_per_step = args.batch * args.seq
    bar = tqdm(range(args.steps), desc=f"{name:>7}", unit="step", leave=True)
    for i in bar:
        ids = next(data).to(device)
        meter.start()
        began = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        step(loss)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        result.step_s.append(time.perf_counter() - began)
        if i > 0:  # step 0 creates optimizer state: part of the steady-state peak afterwards
            result.peak_mib = max(result.peak_mib, meter.peak() / 2**20)
        result.losses.append(loss.item())
        tok_s = tokens_per_step / statistics.median(result.step_s[-20:])
        bar.set_postfix_str(
            f"loss {result.losses[-1]:.3f}, {tok_s:,.0f} tok/s, peak {result.peak_mib:.0f} MiB"
        )
    if hasattr(opt, "flush_report"):
        opt.flush_report()
    result.loss_after = held_out_loss(model, held_ids, args.seq, device)
    result.tokens_per_s = tokens_per_step / statistics.median(result.step_s[1:] or result.step_s)
    state = getattr(opt, "state", {})
    result.state_mib = (
        sum(  # type: ignore[attr-defined]
            v.numel() * v.element_size()
            for s in state.values()
            for v in (s.values() if isinstance(s, dict) else [])
            if torch.is_tensor(v)
        )
        / 2**20
    )
    return result


def table(results: list[Result]) -> str:
    lines = [
        "| optimizer | lr | held-out loss before -> after | tokens/s | median step | "
        "peak above model (MiB) | optimizer state (MiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.optimizer} | {r.lr:g} | {r.loss_before:.3f} -> {r.loss_after:.3f} | "
            f"{r.tokens_per_s:,.0f} | {statistics.median(r.step_s) * 1e3:.0f} ms | "
            f"{r.peak_mib:.1f} | {r.state_mib:.1f} |"  # type: ignore[attr-defined]
        )
    return "\n".join(lines)


def plot(results: list[Result], path: str, title: str) -> None:
    from .tools.plots import _pyplot

    plt = _pyplot()
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(13, 3.8), width_ratios=(2, 1, 1))
    for r in results:
        a.plot(r.losses, lw=0.8, label=f"{r.optimizer} (held-out {r.loss_after:.2f})")
    a.set_xlabel("step")
    a.set_ylabel("training loss")
    a.legend(fontsize=8)
    a.grid(alpha=0.3)
    names = [r.optimizer for r in results]
    b.bar(names, [r.peak_mib for r in results], color="#c44e52")
    b.set_ylabel("peak above the model (MiB)")
    c.bar(names, [statistics.median(r.step_s) * 1e3 for r in results], color="#4c72b0")
    c.set_ylabel("median step time (ms)")
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--optimizers",
        type=comma_list(OPTIMIZERS),
        default="lomo,adamw",
        help=f"comma list of {', '.join(OPTIMIZERS)}",
    )
    parser.add_argument("--size", choices=list(SIZES), default="small")
    parser.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default=None,
        help="default: bf16 where bf16 matmuls are native (GPUs, CPUs with AVX-512 BF16 or AMX), "
        "else fp32 (torch emulates bf16 matmuls about 40x slower there)",
    )
    parser.add_argument("--steps", type=positive_int, default=200)
    parser.add_argument("--batch", type=positive_int, default=8)
    parser.add_argument("--seq", type=whole_number(MIN_SEQ, MAX_SEQ), default=128)
    parser.add_argument("--lr", type=positive_float, default=None, help="default per optimizer")
    parser.add_argument("--clip-grad-norm", type=positive_float, default=1.0)
    parser.add_argument("--device", type=device, default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--threads", type=positive_int, default=1, help="CPU threads (1: shared 2-core machines)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", type=plot_path, default=None, help="write the PNG here")


def run(args: argparse.Namespace) -> list[Result]:
    """Train with each optimizer, print the table (and write the plot); the results."""
    from lomo_kernels.ops import backends

    from .tools import machine

    torch.set_num_threads(args.threads)
    device = args.device
    if args.dtype is None:
        args.dtype = machine.fast_dtype(device)
    hidden, inter, layers, heads = SIZES[args.size]
    n_params = sum(p.numel() for p in build_model(args.size, DTYPES[args.dtype], 0).parameters())
    backend = backends.backend_name(backends.resolve(torch.device(device)))
    print(
        f"LLaMA architecture: {n_params / 1e6:.1f}M parameters (hidden {hidden}, {layers} "
        f"layers), {args.dtype}, {device}; {args.steps} steps of {args.batch} x {args.seq} "
        f"characters; Lomo kernels: {backend} backend"
    )
    results = [train(name, args, device) for name in args.optimizers]
    info = machine.describe(device)
    print()
    print(machine.one_line(info))
    print(table(results))
    if args.plot:
        plot(
            results,
            args.plot,
            f"demo, {n_params / 1e6:.1f}M-parameter LLaMA, {args.dtype}; " + machine.one_line(info),
        )
        print(f"plot: {args.plot}")
    for r in results:
        if not r.loss_after < r.loss_before:
            raise SystemExit(f"{r.optimizer}: the held-out loss did not fall: something is wrong")
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
