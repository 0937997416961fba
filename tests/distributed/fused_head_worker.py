"""One rank of the fused-head ZeRO-3 check (run by tests/test_fused_head_sharded.py under
torchrun, gloo, CPU): a LLaMA whose head (3001 x 40, above ZeRO-3's persistence threshold, so
partitioned) feeds the logits-free loss, trained with Lomo and AdaLomo; rank 0 saves the
consolidated initial and final parameters for the one-process reference."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sharded_models import LR, OPTIONS, FusedHeadLlama, rank_batch, train  # noqa: E402

from lomo_kernels import AdaLomo, Lomo  # noqa: E402
from lomo_kernels.distributed import consolidated_state_dict  # noqa: E402

torch.set_num_threads(1)
OUT = Path(sys.argv[1])
CONFIG = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}


def run(name: str, cls, rank: int) -> None:
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=CONFIG):
        model = FusedHeadLlama()
    engine, *_ = deepspeed.initialize(model=model, config=CONFIG)
    model = engine.module
    head = model.llama.lm_head.weight
    initial = consolidated_state_dict(model)
    opt = cls(engine, lr=LR[name], bucket_numel=3000, **OPTIONS)
    train(model, opt, lambda step: rank_batch(step, rank))
    final = consolidated_state_dict(model)
    if rank == 0:
        partitioned = head.ds_tensor.numel() < head.ds_numel
        torch.save({"initial": initial, "final": final, "head_partitioned": partitioned},
                   OUT / f"{name}.pt")  # fmt: skip


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    run("lomo", Lomo, rank)
    run("adalomo", AdaLomo, rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
