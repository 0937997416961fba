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

import finetune_common as common
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import LlamaForCausalLM


def main() -> None:
    parser = common.arguments(__doc__.split("\n")[0], save="fsdp2_consolidated.pt")
    parser.add_argument(
        "--precision",
        choices=("bf16-compute", "bf16", "fp32"),
        default="bf16-compute",
        help="bf16-compute: fp32 shards, bf16 forward/backward (MixedPrecisionPolicy)",
    )
    args = parser.parse_args()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    device = common.one_core_per_rank_or_gpu()

    torch.manual_seed(0)  # the same initial weights on every rank
    model = LlamaForCausalLM(common.llama_config(args)).to(device)
    policy = MixedPrecisionPolicy()
    if args.precision == "bf16":
        model = model.to(torch.bfloat16)
    elif args.precision == "bf16-compute":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)  # the root: embeddings, final norm, head
    opt = common.optimizer(model, args)

    def step(batch: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=batch, labels=batch).loss
        if opt.clip_grad_norm is not None:
            opt.grad_norm(loss)  # norm pass over the same graph (lomo-optim's pattern)
        opt.fused_backward(loss)
        return loss

    common.train(args, device, opt, step)
    common.save_consolidated(model, opt, args.save)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
