"""Step time of a Lomo training step, eager vs torch.compile (method: MEASURING.md).

    python bench/bench_compile.py [--repeats N] [--hidden H --layers L --batch B --seq S]

Three loops on copies of one LLaMA-architecture model, each compiled in its own warm-up
steps, then timed interleaved (eager, compiled forward, compiled forward + compiled
autograd, eager, ...): the median step of each and the ratios of the medians, one process.
A step is forward + fused_backward (Lomo, clip_grad_norm=1.0: norm pass + update pass).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo import compiled_autograd

from lomo_kernels import Lomo
from lomo_kernels.tools.machine import cpu_model

THREADS = 2
WAYS = ("eager", "compiled forward", "compiled forward + compiled autograd")


def build(hidden: int, layers: int, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=8000,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64),
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(dtype).train()


def make_step(model: torch.nn.Module, way: str) -> Callable[[dict[str, Any]], None]:
    opt = Lomo(model, lr=1e-3, clip_grad_norm=1.0)
    forward = model if way == "eager" else torch.compile(model)
    use_ca = way == "compiled forward + compiled autograd"

    def step(inputs: dict[str, Any]) -> None:
        loss = forward(**inputs).loss
        if use_ca:
            with compiled_autograd._enable(torch.compile(backend="inductor")):
                opt.fused_backward(loss)
        else:
            opt.fused_backward(loss)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    base = build(args.hidden, args.layers, dtype)
    ids = torch.randint(0, 8000, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "labels": ids}
    steps = {way: make_step(copy.deepcopy(base), way) for way in WAYS}
    for way, step in steps.items():
        start = time.perf_counter()
        for _ in range(args.warmup):  # compiles, lazy state
            step(inputs)
        print(f"warm-up {way}: {time.perf_counter() - start:.1f} s", flush=True)
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    for _ in range(args.repeats):
        for way, step in steps.items():
            start = time.perf_counter()
            step(inputs)
            times[way].append(time.perf_counter() - start)
    cpu = cpu_model()
    import transformers

    n_params = sum(p.numel() for p in base.parameters())
    print(
        f"CPU: {cpu}, {os.cpu_count()} cores; threads {torch.get_num_threads()}; torch "
        f"{torch.__version__}; transformers {transformers.__version__}; "
        f"model {n_params / 1e6:.0f}M params ({args.layers} layers, hidden {args.hidden}), "
        f"{args.dtype}, batch "
        f"{args.batch} x {args.seq}; {args.repeats} interleaved repeats, medians"
    )
    eager = statistics.median(times["eager"])
    print("\n| loop | median step (ms) | vs eager |\n|---|---|---|")
    for way in WAYS:
        med = statistics.median(times[way])
        print(f"| {way} | {med * 1e3:.1f} | {med / eager:.2f}x |")


if __name__ == "__main__":
    main()
