"""One rank of the fused-head ZeRO-3 and FSDP2 checks (test_fused_head_sharded.py runs
it under torchrun, gloo, CPU): a LLaMA whose head (3001 x 40: above ZeRO-3's persistence
threshold, so partitioned; sharded with the root under FSDP2) feeds the logits-free loss,
trained with Lomo and AdaLomo; rank 0 saves the consolidated initial and final parameters
for the one-process reference."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from support.sharded_models import LR, OPTIONS, FusedHeadLlama, rank_batch, train  # noqa: E402

from lomo_kernels import AdaLomo, Lomo  # noqa: E402
from lomo_kernels.distributed import consolidated_state_dict  # noqa: E402

torch.set_num_threads(1)
OUT = Path(sys.argv[1])
CONFIG = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}


def run_zero3(name: str, cls, rank: int) -> None:
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
                   OUT / f"zero3_{name}.pt")  # fmt: skip


def run_fsdp2(name: str, cls, rank: int) -> None:
    torch.manual_seed(0)
    model = FusedHeadLlama()
    for layer in model.llama.model.layers:
        fully_shard(layer)
    fully_shard(model)
    initial = consolidated_state_dict(model)
    opt = cls(model, lr=LR[name], **OPTIONS)
    train(model, opt, lambda step: rank_batch(step, rank))
    final = consolidated_state_dict(model)
    if rank == 0:
        head = model.llama.lm_head.weight
        partitioned = head.to_local().numel() < head.numel()
        torch.save({"initial": initial, "final": final, "head_partitioned": partitioned},
                   OUT / f"fsdp2_{name}.pt")  # fmt: skip


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    for name, cls in (("lomo", Lomo), ("adalomo", AdaLomo)):
        run_zero3(name, cls, rank)
        run_fsdp2(name, cls, rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
