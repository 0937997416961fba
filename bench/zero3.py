"""`python -m bench.zero3`: ZeRO-3 on 2 ranks, per-rank peak memory above the model and
step time, ours against DeepSpeed's.

    python -m bench.zero3 [--steps N] [--batch B --seq S] [--configs lomo,...] [--json F]

Configurations (each in fresh processes on 2 ranks, gloo on CPU: `sharded`):
  lomo           Lomo on the ZeRO-3 partitions (one backward per step)
  lomo_clip      Lomo with clip_grad_norm=1.0 (norm pass + update pass, a forward each)
  deepspeed_sgd  DeepSpeed ZeRO-3 with its own optimizer wrapping torch.optim.SGD, no offload
                 (engine.backward + engine.step: gradient partitions and fp32 master weights)

Memory (MEASURING.md, per rank): the baseline is VmRSS once the partitioned bf16 model and
the inputs exist (before any optimizer), and the figure is the max over steps 1..N-1 of
VmHWM (reset before each step) minus that baseline. Step times come from separate runs
without the malloc setting (it slows allocation): the median over steps 1..N-1 of the slower
rank. CPU figures: they say nothing of GPU timings.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .common import machine
from .common.argtypes import (
    add_counts,
    add_json_argument,
    add_list_argument,
    whole_number,
)
from .common.meter import Meter
from .common.sharded import MODEL, gathered, launch, measure_steps, step_seconds

CONFIGS = ("lomo", "lomo_clip", "deepspeed_sgd")
BASELINE = "deepspeed_sgd"


def rank_main(
    config: str, steps: int, batch: int, seq: int, metered: bool
) -> list[dict[str, Any]] | None:
    """One rank of a run (started by `sharded.launch`): every rank's figures on rank 0."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    from lomo_kernels import Lomo

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    ds_config = {
        "train_micro_batch_size_per_gpu": batch,
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": True},
    }
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = LlamaForCausalLM(MODEL.to_hf_config(max_position_embeddings=seq))
    gen = torch.Generator().manual_seed(rank)
    inputs = iter(
        [torch.randint(0, MODEL.vocab_size, (batch, seq), generator=gen) for _ in range(steps)]
    )
    meter = Meter("cpu") if metered else None
    baseline = meter.current() if meter else 0
    if config == BASELINE:
        sgd = torch.optim.SGD(model.parameters(), lr=1e-3)
        config_opt = {**ds_config, "zero_allow_untested_optimizer": True}
        engine, *_ = deepspeed.initialize(model=model, optimizer=sgd, config=config_opt)

        def step() -> None:
            x = next(inputs)
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()

    else:
        engine, *_ = deepspeed.initialize(model=model, config=ds_config)
        opt = Lomo(engine, lr=1e-3, clip_grad_norm=1.0 if config == "lomo_clip" else None)

        def step() -> None:
            x = next(inputs)
            if opt.clip_grad_norm is not None:
                opt.grad_norm(model(input_ids=x, labels=x).loss)
            opt.fused_backward(model(input_ids=x, labels=x).loss)

    figures = measure_steps(step, steps, "cpu", meter, baseline)
    return gathered({"rank": rank, **figures})


def run(configs: list[str], steps: int, batch: int, seq: int) -> dict[str, dict[str, Any]]:
    """Per configuration: each rank's peak above the model (MiB) and the step time (s)."""
    rows = {}
    for config in configs:
        settings = {"config": config, "steps": steps, "batch": batch, "seq": seq}
        memory = launch(rank_main, metered=True, **settings)
        timing = launch(rank_main, metered=False, **settings)
        rows[config] = {
            "peak_above_model_mib": [max(r["peak_mib"]) for r in memory],
            "step_s": step_seconds(timing),
        }
    return rows


def format_table(rows: dict[str, dict[str, Any]], meta: dict[str, Any]) -> str:
    base = rows.get(BASELINE)
    lines = [
        f"ZeRO-3, 2 ranks, 1 thread per rank; CPU figures; model {MODEL.name} "
        f"({MODEL.num_parameters / 1e6:.1f}M parameters), bf16, batch {meta['batch']} x "
        f"{meta['seq']} per rank, {meta['steps']} steps (step 0 skipped)",
        "| configuration | peak above model, rank 0 / rank 1 (MiB) | step (s) | vs DeepSpeed |",
        "|---|---|---|---|",
    ]
    for config, row in rows.items():
        peaks = " / ".join(f"{p:.0f}" for p in row["peak_above_model_mib"])
        ratio = f"{row['step_s'] / base['step_s']:.2f}x" if base else "-"
        lines.append(f"| {config} | {peaks} | {row['step_s']:.2f} | {ratio} |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=whole_number(2), default=5, help="step 0 not measured")
    add_counts(parser, batch=2, seq=128)
    add_list_argument(parser, "--configs", CONFIGS)
    add_json_argument(parser)


def command(args: argparse.Namespace) -> int:
    rows = run(args.configs, args.steps, args.batch, args.seq)
    meta = machine.describe("cpu") | {
        "model": MODEL.as_dict(),
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
    }
    machine.print_results(meta, format_table(rows, meta), args.json, rows=rows)
    return 0


if __name__ == "__main__":
    from bench.common.cli import main

    sys.exit(main(__spec__.name))
