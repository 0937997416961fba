"""ZeRO-3 on 2 ranks: per-rank peak memory above the model and step time, ours vs DeepSpeed's.

    python bench/zero3.py [--steps N] [--json-out PATH]

Configurations (each in fresh processes under `torchrun --nproc_per_node 2`, gloo on CPU):
  lomo           Lomo on the ZeRO-3 partitions (one backward per step)
  lomo_clip      Lomo with clip_grad_norm=1.0 (norm pass + update pass, a forward each)
  deepspeed_sgd  DeepSpeed ZeRO-3 with its own optimizer wrapping torch.optim.SGD, no offload
                 (engine.backward + engine.step: gradient partitions and fp32 master weights)

Memory follows MEASURING.md per rank: MALLOC_MMAP_THRESHOLD_=65536, the baseline is VmRSS
once the partitioned bf16 model and the inputs exist (before any optimizer), and the figure is
the max over steps 1..N-1 of VmHWM (reset before each step) minus that baseline. Step times
come from separate runs without the malloc setting (it slows allocation): median over steps
1..N-1 of the slower rank. CPU figures: they say nothing of GPU timings.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIGS = ("lomo", "lomo_clip", "deepspeed_sgd")
MODEL = {
    "vocab_size": 32000,
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
}
BATCH, SEQ = 2, 128  # per rank
MIB = 2**20


def worker(config: str, steps: int, measure_memory: bool) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from lomo_kernels import Lomo
    from lomo_kernels.tools.bench_memory import hwm_bytes, reset_hwm, rss_bytes

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    ds_config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": True},
    }
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = LlamaForCausalLM(LlamaConfig(**MODEL, max_position_embeddings=SEQ))
    gen = torch.Generator().manual_seed(rank)
    inputs = [
        torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ), generator=gen) for _ in range(steps)
    ]
    baseline = rss_bytes()
    if config == "deepspeed_sgd":
        sgd = torch.optim.SGD(model.parameters(), lr=1e-3)
        config_opt = {**ds_config, "zero_allow_untested_optimizer": True}
        engine, *_ = deepspeed.initialize(model=model, optimizer=sgd, config=config_opt)

        def step(x):
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()

    else:
        engine, *_ = deepspeed.initialize(model=model, config=ds_config)
        opt = Lomo(engine, lr=1e-3, clip_grad_norm=1.0 if config == "lomo_clip" else None)

        def step(x):
            if opt.clip_grad_norm is not None:
                opt.grad_norm(model(input_ids=x, labels=x).loss)
            opt.fused_backward(model(input_ids=x, labels=x).loss)

    peaks, times = [], []
    for i, x in enumerate(inputs):
        dist.barrier()
        if measure_memory:
            reset_hwm()
        start = time.perf_counter()
        step(x)
        times.append(time.perf_counter() - start)
        if measure_memory:
            peaks.append(hwm_bytes() - baseline)
        if i == 0:
            peaks, times = [], []  # step 0: lazy state and first-call allocations
    result = {"rank": rank, "peak_above_model": max(peaks, default=0), "times": times}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, result)
    if rank == 0:
        print("RESULT " + json.dumps(everyone), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(config: str, steps: int, measure_memory: bool) -> list[dict[str, Any]]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if measure_memory:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_port", str(free_port()), __file__, "--worker", config, "--steps", str(steps),
    ]  # fmt: skip
    if measure_memory:
        command.append("--memory")
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"{config} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--worker", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--memory", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.memory)
        return
    from lomo_kernels.tools.machine import describe, one_line

    rows = {}
    for config in CONFIGS:
        memory = launch(config, args.steps, measure_memory=True)
        timing = launch(config, args.steps, measure_memory=False)
        step_s = [max(r["times"][i] for r in timing) for i in range(len(timing[0]["times"]))]
        rows[config] = {
            "peak_above_model_mib": [r["peak_above_model"] / MIB for r in memory],
            "step_s": statistics.median(step_s),
        }
        print(config, rows[config], file=sys.stderr, flush=True)
    base = rows["deepspeed_sgd"]
    print(f"ZeRO-3, 2 ranks, {one_line(describe('cpu'))}; 1 thread per rank; CPU figures")
    print(f"model {MODEL}, bf16, batch {BATCH} x {SEQ} per rank, {args.steps} steps")
    print("| configuration | peak above model, rank 0 / rank 1 (MiB) | step (s) | vs DeepSpeed |")
    print("|---|---|---|---|")
    for config, row in rows.items():
        peaks = " / ".join(f"{p:.0f}" for p in row["peak_above_model_mib"])
        ratio = row["step_s"] / base["step_s"]
        print(f"| {config} | {peaks} | {row['step_s']:.2f} | {ratio:.2f}x |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"model": MODEL, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
