"""Full-parameter fine-tuning of a LLaMA-architecture model with Lomo under FSDP2.

    torchrun --nproc_per_node 2 examples/fsdp2_finetune.py            # CPU: gloo
    torchrun --nproc_per_node 8 examples/fsdp2_finetune.py --steps 200 --hidden 1024

Runs unchanged on GPUs (NCCL) and on CPU (gloo). PyTorch's own FSDP2 (`fully_shard`)
shards every parameter by rows; after backward it reduce-scatters each unit's gradients and
calls the optimizer's hooks, which update this rank's rows with the fused kernels and drop
the gradient shard at once. At the end rank 0 writes a consolidated (unsharded) checkpoint
that loads in one process.

Set-up that must hold (see README, 'Sharded training (FSDP2)'): fully_shard on the root
module too (every trainable parameter in an FSDP2 unit), a 1-D mesh, the default Shard(0)
placement, no CPU offload, and opt.fused_backward(loss) instead of loss.backward().
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

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
        "--precision",
        choices=("bf16-compute", "bf16", "fp32"),
        default="bf16-compute",
        help="bf16-compute: fp32 shards, bf16 forward/backward (MixedPrecisionPolicy)",
    )
    parser.add_argument("--save", default="fsdp2_consolidated.pt")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    else:
        torch.set_num_threads(1)  # one core per rank
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    torch.manual_seed(0)  # the same initial weights on every rank
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=256,
            hidden_size=args.hidden,
            intermediate_size=args.hidden * 11 // 4,
            num_hidden_layers=args.layers,
            num_attention_heads=max(1, args.hidden // 64),
            max_position_embeddings=args.seq,
        )
    ).to(device)
    policy = MixedPrecisionPolicy()
    if args.precision == "bf16":
        model = model.to(torch.bfloat16)
    elif args.precision == "bf16-compute":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)  # the root: embeddings, final norm, head

    lr = args.lr if args.lr is not None else (0.3 if args.optimizer == "lomo" else 0.03)
    cls = Lomo if args.optimizer == "lomo" else AdaLomo
    opt = cls(model, lr=lr, clip_grad_norm=args.clip_grad_norm or None, weight_decay=0.01)

    # Toy data: each rank learns to continue a byte sequence with a fixed period.
    gen = torch.Generator().manual_seed(rank)
    start = time.perf_counter()
    for step in range(args.steps):
        offsets = torch.randint(0, 256, (args.batch, 1), generator=gen)
        x = ((offsets + torch.arange(args.seq) * 7) % 256).to(device)
        loss = model(input_ids=x, labels=x).loss
        if opt.clip_grad_norm is not None:
            opt.grad_norm(loss)  # norm pass over the same graph (lomo-optim's pattern)
        opt.fused_backward(loss)
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            norm = "-" if opt.last_grad_norm is None else f"{opt.last_grad_norm.item():.3f}"
            print(f"step {step:4d}  loss {loss.item():.4f}  grad norm {norm}")
    opt.flush_report()
    if rank == 0:
        print(f"{args.steps} steps on {world} ranks in {time.perf_counter() - start:.1f} s")
    state = consolidated_state_dict(model)  # a collective: every rank calls it
    opt_state = opt.consolidated_state_dict()
    if rank == 0:
        torch.save({"model": state, "optimizer": opt_state}, args.save)
        print(f"consolidated checkpoint: {args.save} (loads with model.load_state_dict)")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
