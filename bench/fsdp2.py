"""FSDP2 on 2 ranks: per-rank peak memory above the model and step time, per optimizer.

    python bench/fsdp2.py [--rounds 2] [--steps 4] [--batch 2 --seq 128] [--json-out PATH]

Each configuration runs in a fresh `torchrun --nproc_per_node 2` (gloo on CPU, NCCL on
GPUs), started with MALLOC_MMAP_THRESHOLD_=65536 (memory method of bench/memory.py); the
configurations are interleaved over `--rounds` rounds and the step time is the median over
rounds of each run's median step (step 0 skipped; the slowest rank's time, after a barrier).
Memory: VmHWM reset before each step and read after it, minus the rank's RSS once the
sharded model, the optimizer and the inputs exist; the figure is the largest over ranks and
steps 1..N-1 (so AdamW's states, created in step 0, count). On CUDA the same figures are
read from torch.cuda.max_memory_allocated.

Model: a transformers LLaMA (hidden 512, intermediate 1408, 4 layers, 8 heads, vocab 32000:
45.6M parameters), fully_shard on each decoder layer, the embedding, the final norm with
the head (one unit), and the root (torchtitan's units); fp32 shards computed
in bf16 (MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)) unless --precision bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lomo_kernels.tools.bench_memory import (  # noqa: E402
    MMAP_ENV,
    MMAP_VALUE,
    hwm_bytes,
    reset_hwm,
    rss_bytes,
)
from lomo_kernels.tools.bench_memory import child_env as mmap_env  # noqa: E402
from lomo_kernels.tools.machine import cpu_model  # noqa: E402

MB = 2**20

LR = 1e-3
CONFIGS = ("sgd", "adamw", "lomo", "lomo_clip", "adalomo")
LABELS = {
    "sgd": "FSDP2 + torch.optim.SGD (foreach; backward, step, zero_grad)",
    "adamw": "FSDP2 + torch.optim.AdamW (fused)",
    "lomo": "FSDP2 + lomo_kernels.Lomo (fused_backward)",
    "lomo_clip": "FSDP2 + Lomo, clip_grad_norm=1.0 (grad_norm + fused_backward, one loss)",
    "adalomo": "FSDP2 + lomo_kernels.AdaLomo",
}


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    from lomo_kernels import AdaLomo, Lomo

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    else:
        if os.environ.get(MMAP_ENV) != MMAP_VALUE:
            raise RuntimeError(f"{MMAP_ENV}={MMAP_VALUE} must be set before the process starts")
        torch.set_num_threads(1)  # one core per rank
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32000,
            hidden_size=512,
            intermediate_size=1408,
            num_hidden_layers=4,
            num_attention_heads=8,
            max_position_embeddings=args.seq,
        )
    ).to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if args.precision == "bf16":
        model, policy = model.to(torch.bfloat16), MixedPrecisionPolicy()
    # torchtitan's units: each decoder layer, the embedding, the final norm with the head,
    # and the root.
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model.model.embed_tokens, mp_policy=policy)
    fully_shard([model.model.norm, model.lm_head], mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    params = list(model.parameters())
    config = args.rank_run
    if config == "sgd":
        # torch 2.13 has no DTensor rule for _fused_sgd_: the foreach implementation.
        opt = torch.optim.SGD(params, lr=LR, foreach=True)
    elif config == "adamw":
        opt = torch.optim.AdamW(params, lr=LR, fused=True)
    elif config == "adalomo":
        opt = AdaLomo(model, lr=LR)
    else:
        opt = Lomo(model, lr=LR, clip_grad_norm=1.0 if config == "lomo_clip" else None)
    gen = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, 32000, (args.batch, args.seq), generator=gen).to(device)

    def step() -> None:
        loss = model(input_ids=ids, labels=ids).loss
        if config in ("sgd", "adamw"):
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return
        if opt.clip_grad_norm is not None:
            opt.grad_norm(loss)
        opt.fused_backward(loss)

    dist.barrier()
    baseline = torch.cuda.memory_allocated() if cuda else rss_bytes()
    peaks, times = [], []
    for i in range(args.steps):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            reset_hwm()
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() if cuda else hwm_bytes()) - baseline
        dist.barrier()
        elapsed = time.perf_counter() - start
        if i > 0:
            peaks.append(peak / MB)
            times.append(elapsed)
    if hasattr(opt, "flush_report"):
        opt.flush_report()
    result = {
        "config": config,
        "rank": rank,
        "device": str(device),
        "peak_mb": max(peaks),
        "step_s": statistics.median(times),
        "shard_mb": sum(p.to_local().numel() * p.to_local().element_size() for p in params) / MB,
        "params": sum(p.numel() for p in params),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    Path(args.json_dir, f"{config}.{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def run_config(config: str, args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_port", str(29500 + os.getpid() % 1000), os.path.abspath(__file__),
        "--rank-run", config, "--json-dir", str(out), "--steps", str(args.steps),
        "--batch", str(args.batch), "--seq", str(args.seq), "--precision", args.precision,
    ]  # fmt: skip
    env = {**mmap_env(), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{config} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return [json.loads(Path(out, f"{config}.{r}.json").read_text()) for r in range(2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rank-run", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--json-dir", help=argparse.SUPPRESS)
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--precision", choices=("bf16-compute", "bf16"), default="bf16-compute")
    parser.add_argument("--json-out")
    args = parser.parse_args()
    if args.rank_run:
        rank_main(args)
        return
    runs: dict[str, list[list[dict[str, Any]]]] = {c: [] for c in args.configs}
    with tempfile.TemporaryDirectory() as out:
        for _ in range(args.rounds):  # interleaved: A, B, C, A, B, C
            for config in args.configs:
                runs[config].append(run_config(config, args, Path(out)))
    first = runs[args.configs[0]][0][0]
    cpu = cpu_model()
    print(
        f"{first['device']} ({cpu}, {os.cpu_count()} cores), 2 ranks x {first['threads']} "
        f"thread(s); torch {first['torch']}; transformers {first['transformers']}; "
        f"{first['params'] / 1e6:.1f}M parameters, {first['shard_mb']:.0f} MB of shards per "
        f"rank ({args.precision}); batch {args.batch} x {args.seq} per rank; {args.steps} steps "
        f"(step 0 skipped), {args.rounds} rounds"
    )
    print("\n| configuration | peak above model per rank (MB) | step time (s) |\n|---|---|---|")
    summary = []
    for config in args.configs:
        peak = max(r["peak_mb"] for run in runs[config] for r in run)
        step_s = statistics.median(max(r["step_s"] for r in run) for run in runs[config])
        summary.append({"config": config, "peak_mb": peak, "step_s": step_s})
        print(f"| {LABELS[config]} | {peak:.0f} | {step_s:.2f} |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"runs": runs, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
