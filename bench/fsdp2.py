"""`python -m bench.fsdp2`: FSDP2 on 2 ranks, per-rank peak memory above the model and
step time, per optimizer.

    python -m bench.fsdp2 [--rounds 2] [--steps 4] [--batch 2 --seq 128]
                             [--precision bf16-compute|bf16] [--configs sgd,adamw,...] [--json F]

Each configuration runs in fresh processes on 2 ranks (`sharded`: gloo on CPU, NCCL on
GPUs), metered; the configurations are interleaved over `--rounds` rounds and the step time
is the median over rounds of each run's step time. Memory: the peak of each step above the
rank's memory once the sharded model, the optimizer and the inputs exist; the figure is the
largest over ranks, steps 1..N-1 and rounds (so AdamW's states, created in step 0, count).

The model (`sharded.MODEL`) is sharded as torchtitan does: fully_shard on each decoder layer,
the embedding, the final norm with the head (one unit), and the root; fp32 shards computed
in bf16 (MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)) unless --precision bf16.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

from .common import machine
from .common.argtypes import (
    add_counts,
    add_json_argument,
    add_list_argument,
    whole_number,
)
from .common.meter import MIB, Meter, require_metered_process
from .common.models import build_model
from .common.sharded import MODEL, gathered, launch, measure_steps, step_seconds

LR = 1e-3
CONFIGS = ("sgd", "adamw", "lomo", "lomo_clip", "adalomo")
LABELS = {
    "sgd": "FSDP2 + torch.optim.SGD (foreach; backward, step, zero_grad)",
    "adamw": "FSDP2 + torch.optim.AdamW (fused)",
    "lomo": "FSDP2 + lomo_kernels.Lomo (fused_backward)",
    "lomo_clip": "FSDP2 + Lomo, clip_grad_norm=1.0 (grad_norm + fused_backward, one loss)",
    "adalomo": "FSDP2 + lomo_kernels.AdaLomo",
}
PRECISIONS = ("bf16-compute", "bf16")


def rank_main(
    config: str, steps: int, batch: int, seq: int, precision: str, metered: bool
) -> list[dict[str, Any]] | None:
    """One rank of a run (started by `sharded.launch`): every rank's figures on rank 0."""
    import torch
    import torch.distributed as dist
    import transformers
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from lomo_kernels import AdaLomo, Lomo

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    else:
        require_metered_process()
        torch.set_num_threads(1)  # one core per rank
    device = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
    model = build_model(MODEL, "fp32", device, seed=0, max_position_embeddings=seq)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if precision == "bf16":
        model, policy = model.to(torch.bfloat16), MixedPrecisionPolicy()
    # torchtitan's units: each decoder layer, the embedding, the final norm with the head,
    # and the root.
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model.model.embed_tokens, mp_policy=policy)
    fully_shard([model.model.norm, model.lm_head], mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    params = list(model.parameters())
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
    ids = torch.randint(0, MODEL.vocab_size, (batch, seq), generator=gen).to(device)

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
    meter = Meter(device) if metered else None
    figures = measure_steps(step, steps, device, meter, meter.current() if meter else 0)
    if hasattr(opt, "flush_report"):
        opt.flush_report()
    shards = [p.to_local() for p in params]
    return gathered(
        {
            "config": config,
            "rank": rank,
            "device": device,
            "shard_mib": sum(s.numel() * s.element_size() for s in shards) / MIB,
            "params": sum(p.numel() for p in params),
            "threads": torch.get_num_threads(),
            "transformers": transformers.__version__,
            **figures,
        }
    )


def run(
    configs: list[str], rounds: int, steps: int, batch: int, seq: int, precision: str
) -> dict[str, list[list[dict[str, Any]]]]:
    """Every configuration's runs (each a list of the ranks' figures), interleaved: A, B, C,
    A, B, C, ..."""
    runs: dict[str, list[list[dict[str, Any]]]] = {config: [] for config in configs}
    settings = {"steps": steps, "batch": batch, "seq": seq, "precision": precision}
    for _ in range(rounds):
        for config in configs:
            runs[config].append(launch(rank_main, metered=True, config=config, **settings))
    return runs


def summary(runs: dict[str, list[list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """Per configuration: the largest peak above the model (MiB) and the median step (s)."""
    return [
        {
            "config": config,
            "peak_mib": max(max(rank["peak_mib"]) for ranks in done for rank in ranks),
            "step_s": statistics.median(step_seconds(ranks) for ranks in done),
        }
        for config, done in runs.items()
    ]


def format_table(rows: list[dict[str, Any]], first: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [
        f"{first['device']}, 2 ranks x {first['threads']} thread(s); transformers "
        f"{first['transformers']}; {first['params'] / 1e6:.1f}M parameters, "
        f"{first['shard_mib']:.0f} MiB of shards per rank ({meta['precision']}); batch "
        f"{meta['batch']} x {meta['seq']} per rank; {meta['steps']} steps (step 0 skipped), "
        f"{meta['rounds']} rounds",
        "| configuration | peak above model per rank (MiB) | step time (s) |",
        "|---|---|---|",
    ]
    for row in rows:
        lines.append(f"| {LABELS[row['config']]} | {row['peak_mib']:.0f} | {row['step_s']:.2f} |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_list_argument(parser, "--configs", CONFIGS)
    parser.add_argument("--steps", type=whole_number(2), default=4, help="step 0 not measured")
    add_counts(parser, rounds=2, batch=2, seq=128)
    parser.add_argument("--precision", choices=PRECISIONS, default="bf16-compute")
    add_json_argument(parser)


def command(args: argparse.Namespace) -> int:
    runs = run(args.configs, args.rounds, args.steps, args.batch, args.seq, args.precision)
    rows = summary(runs)
    first = runs[args.configs[0]][0][0]
    meta = machine.describe(first["device"]) | {
        key: getattr(args, key) for key in ("rounds", "steps", "batch", "seq", "precision")
    }
    table = format_table(rows, first, meta)
    machine.print_results(meta, table, args.json, summary=rows, runs=runs)
    return 0


if __name__ == "__main__":
    from bench.common.cli import main

    sys.exit(main(__spec__.name))
