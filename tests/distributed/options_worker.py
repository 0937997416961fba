"""One rank of the optimizer options' checks on sharded parameters (run by
test_sharded_options.py under torchrun, gloo, CPU): ZeRO-3 and FSDP2, Lomo and AdaLomo on
TiedScaledLlama (the head is the embedding) with its first decoder layer frozen, a param
group of its own for the norms and the temperature, and clipping by value and by norm
together (`combined_options`); each optimizer with a norm pass and an update pass per step,
and with accumulation (k micro-batches per step, then a short step applied by opt.step()) and
reentrant activation checkpointing; a checkpoint at the end of the first
(`lomo_kernels.save_checkpoint`).

Writes, on rank 0, to the directory in argv[1]: each run's consolidated initial and final
parameters (and of the first, the optimizer's consolidated state and the checkpoint) for the
one-process reference, and `checks.json` with each rank's step count.
"""

from __future__ import annotations

import sys
from pathlib import Path

import deepspeed
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from accumulation_worker import build  # noqa: E402
from support.sharded_checks import OPTIMIZERS, run_worker  # noqa: E402
from support.sharded_models import (  # noqa: E402
    LR,
    TRAININGS,
    TiedScaledLlama,
    combined_options,
    freeze_first_layer,
    rank_batch,
)

import lomo_kernels  # noqa: E402
from lomo_kernels.distributed import consolidated_state_dict  # noqa: E402

torch.set_num_threads(1)
OUT = Path(sys.argv[1])


def run(engine: str, name: str, training: str, rank: int, checks: dict) -> None:
    target, model = build(engine, TiedScaledLlama)
    if training == "accumulating":  # its layers recomputed in backward, as large models train
        model.llama.activation_checkpointing_enable({"use_reentrant": True})
        model.train()
    freeze_first_layer(model)
    initial = consolidated_state_dict(model)
    options = combined_options(model, name, accumulate=training == "accumulating")
    opt = OPTIMIZERS[name](target, lr=LR[name], **options)
    TRAININGS[training](model, opt, lambda step: rank_batch(step, rank))
    key = f"{engine}_{name}_{training}"
    checks[key] = {
        "step_count": opt.step_count,
        "recomputed": model.llama.is_activation_checkpointing,
    }
    final = {"initial": initial, "final": consolidated_state_dict(model)}
    if training == "per_step":  # and a checkpoint of the end, for one process to resume
        lomo_kernels.save_checkpoint(OUT / f"{key}_checkpoint", target, opt)
        final["optimizer"] = opt.consolidated_state_dict()
    if rank == 0:
        torch.save(final, OUT / f"{key}.pt")


def main(rank: int, checks: dict) -> None:
    for engine in ("zero3", "fsdp2"):
        for name in ("lomo", "adalomo"):
            for training in TRAININGS:
                run(engine, name, training, rank, checks)


if __name__ == "__main__":
    run_worker(lambda: deepspeed.init_distributed(dist_backend="gloo"), main, OUT)
