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

import deepspeed
import finetune_common as common
import torch
from transformers import LlamaForCausalLM  # import before zero.Init


def main() -> None:
    parser = common.arguments(__doc__.split("\n")[0], save="zero3_consolidated.pt")
    parser.add_argument(
        "--single-backward", action="store_true", help="no norm pass (single_backward=True)"
    )
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    device = common.one_core_per_rank_or_gpu()
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": args.dtype == "bf16"},
    }
    torch.manual_seed(0)  # the same initial weights on every rank, and from run to run
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = LlamaForCausalLM(common.llama_config(args))
    engine, *_ = deepspeed.initialize(model=model, config=config)  # no optimizer
    opt = common.optimizer(engine, args, single_backward=args.single_backward)

    def step(batch: torch.Tensor) -> torch.Tensor:
        if opt.clip_grad_norm is not None and not opt.single_backward:
            opt.grad_norm(model(input_ids=batch, labels=batch).loss)  # norm pass: own forward
        loss = model(input_ids=batch, labels=batch).loss
        opt.fused_backward(loss)
        return loss

    common.train(args, device, opt, step)
    common.save_consolidated(engine, opt, args.save)


if __name__ == "__main__":
    main()
