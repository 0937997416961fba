"""What the two sharded fine-tuning examples share: their arguments, the model, the toy data,
the step report and the consolidated checkpoint (torchrun puts this folder on sys.path)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from transformers import LlamaConfig

from lomo_kernels import AdaLomo, Lomo
from lomo_kernels.distributed import consolidated_state_dict


def arguments(description: str, save: str) -> argparse.ArgumentParser:
    """The options both examples take; each adds its own precision options."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--optimizer", choices=("lomo", "adalomo"), default="lomo")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--clip-grad-norm", type=float, default=1.0, help="0: no clipping")
    parser.add_argument("--save", default=save, help="consolidated checkpoint ('': none)")
    return parser


def one_core_per_rank_or_gpu() -> torch.device:
    """This rank's device: its GPU (NCCL), else the CPU with one thread (gloo)."""
    rank = dist.get_rank()
    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    torch.set_num_threads(1)
    return torch.device("cpu")


def llama_config(args: argparse.Namespace) -> LlamaConfig:
    """A small LLaMA over bytes, its width and depth from the arguments."""
    return LlamaConfig(
        vocab_size=256,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        max_position_embeddings=args.seq,
    )


def optimizer(model: torch.nn.Module, args: argparse.Namespace, **options) -> Lomo | AdaLomo:
    """Lomo or AdaLomo as asked, at the example's default learning rate."""
    lr = args.lr if args.lr is not None else (0.3 if args.optimizer == "lomo" else 0.03)
    cls = Lomo if args.optimizer == "lomo" else AdaLomo
    return cls(
        model, lr=lr, clip_grad_norm=args.clip_grad_norm or None, weight_decay=0.01, **options
    )


def train(
    args: argparse.Namespace,
    device: torch.device,
    opt: Lomo | AdaLomo,
    step_loss: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """`args.steps` steps on toy data: each rank learns to continue a byte sequence with a
    fixed period. `step_loss(batch)` runs one step and returns its loss."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(rank)
    start = time.perf_counter()
    for step in range(args.steps):
        offsets = torch.randint(0, 256, (args.batch, 1), generator=gen)
        batch = ((offsets + torch.arange(args.seq) * 7) % 256).to(device)
        loss = step_loss(batch)
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            norm = "-" if opt.last_grad_norm is None else f"{opt.last_grad_norm.item():.3f}"
            print(f"step {step:4d}  loss {loss.item():.4f}  grad norm {norm}")
    opt.flush_report()
    if rank == 0:
        print(f"{args.steps} steps on {world} ranks in {time.perf_counter() - start:.1f} s")


def save_consolidated(model: torch.nn.Module, opt: Lomo | AdaLomo, path: str) -> None:
    """A checkpoint that loads in one process, written by rank 0 (every rank calls this)."""
    if not path:
        return
    state = consolidated_state_dict(model)  # collectives: every rank takes part
    opt_state = opt.consolidated_state_dict()
    if dist.get_rank() == 0:
        torch.save({"model": state, "optimizer": opt_state}, path)
        print(f"consolidated checkpoint: {path} (loads with model.load_state_dict)")
    dist.barrier()
