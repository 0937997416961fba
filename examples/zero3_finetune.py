"""Full-parameter fine-tuning of a LLaMA-architecture model with Lomo under DeepSpeed ZeRO-3.

    torchrun --nproc_per_node 2 examples/zero3_finetune.py            # CPU: gloo
    torchrun --nproc_per_node 8 examples/zero3_finetune.py --steps 200 --hidden 1024

Runs unchanged on GPUs (NCCL) and on CPU (gloo). Each rank holds 1/W of every parameter;
each gradient is reduce-scatter-averaged to the rank that owns it, in buckets overlapped
with backward, and that rank updates its partition with the fused kernels inside backward.
At the end rank 0 writes a consolidated (unsharded) checkpoint that loads in one process.

Set-up that must hold (see README, 'Sharded training'): no optimizer passed to
deepspeed.initialize, no parameter offload, the forward called on the module (not the
engine), and with clip_grad_norm (or fp16) one forward per backward pass, or
--single-backward (one forward and one backward per step, clipping within the update pass).
"""

from __future__ import annotations

import argparse
import time

import deepspeed
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM  # import before zero.Init

from lomo_kernels import AdaLomo, Lomo
from lomo_kernels.distributed import consolidated_state_dict


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--optimizer", choices=("lomo", "adalomo"), default="lomo")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--clip-grad-norm", type=float, default=1.0, help="0: no clipping")
    parser.add_argument(
        "--single-backward", action="store_true", help="no norm pass (single_backward=True)"
    )
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--save", default="zero3_consolidated.pt")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    cuda = torch.cuda.is_available()
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    else:
        torch.set_num_threads(1)  # one core per rank
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": args.dtype == "bf16"},
    }
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=256,
                hidden_size=args.hidden,
                intermediate_size=args.hidden * 11 // 4,
                num_hidden_layers=args.layers,
                num_attention_heads=max(1, args.hidden // 64),
                max_position_embeddings=args.seq,
            )
        )
    engine, *_ = deepspeed.initialize(model=model, config=config)  # no optimizer
    lr = args.lr if args.lr is not None else (0.3 if args.optimizer == "lomo" else 0.03)
    cls = Lomo if args.optimizer == "lomo" else AdaLomo
    opt = cls(
        engine,
        lr=lr,
        clip_grad_norm=args.clip_grad_norm or None,
        weight_decay=0.01,
        single_backward=args.single_backward,
    )

    # Toy data: each rank learns to continue a byte sequence with a fixed period.
    gen = torch.Generator().manual_seed(rank)
    device = engine.device
    start = time.perf_counter()
    for step in range(args.steps):
        offsets = torch.randint(0, 256, (args.batch, 1), generator=gen)
        x = ((offsets + torch.arange(args.seq) * 7) % 256).to(device)
        if opt.clip_grad_norm is not None and not opt.single_backward:
            opt.grad_norm(model(input_ids=x, labels=x).loss)  # norm pass: its own forward
        loss = model(input_ids=x, labels=x).loss
        opt.fused_backward(loss)
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            norm = "-" if opt.last_grad_norm is None else f"{opt.last_grad_norm.item():.3f}"
            print(f"step {step:4d}  loss {loss.item():.4f}  grad norm {norm}")
    opt.flush_report()
    if rank == 0:
        print(f"{args.steps} steps on {world} ranks in {time.perf_counter() - start:.1f} s")
    state = consolidated_state_dict(engine)  # a collective: every rank calls it
    opt_state = opt.consolidated_state_dict()
    if rank == 0:
        torch.save({"model": state, "optimizer": opt_state}, args.save)
        print(f"consolidated checkpoint: {args.save} (loads with model.load_state_dict)")
    dist.barrier()


if __name__ == "__main__":
    main()
