"""`make demo`: full-parameter fine-tuning of a small LLaMA-architecture model with Lomo.

Runs on the embedded defaults with no download: a character-level model learns an embedded
text. Prints the backend in use, a progress bar with the loss, and a summary (loss before and
after, tokens per second, steps skipped by the loss scaler).

    python -m lomo_kernels.demo [--optimizer lomo|adalomo] [--dtype bf16|fp16|fp32]
                                [--steps N] [--lr LR] [--clip-grad-norm X] [--backend NAME]
"""

from __future__ import annotations

import argparse
import time

import torch

TEXT = (
    "Full-parameter fine-tuning keeps every weight trainable. Plain SGD stores one gradient "
    "per parameter until the step; LOMO applies the step to each parameter inside backward, "
    "as soon as its gradient exists, and frees that gradient at once. Peak memory then holds "
    "the weights, the activations and a single gradient. "
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def build_model(dtype: torch.dtype, seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(dtype).train()


def batches(seq: int, batch: int, seed: int):
    """Random windows of the embedded text, as character ids."""
    data = torch.tensor([min(ord(c), 127) for c in TEXT * 4])
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen)
        ids = torch.stack([data[s : s + seq] for s in starts.tolist()])
        yield {"input_ids": ids, "labels": ids}


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--optimizer", choices=["lomo", "adalomo"], default="lomo")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument(
        "--lr", type=float, default=None, help="default 0.3 for lomo, 0.02 for adalomo"
    )
    parser.add_argument("--clip-grad-norm", type=float, default=1.0)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--backend", default=None, help="triton, cpp, torch (default: auto)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from tqdm import tqdm

    from lomo_kernels import AdaLomo, Lomo, backends

    torch.set_num_threads(min(2, torch.get_num_threads()))
    model = build_model(DTYPES[args.dtype], args.seed)
    device = next(model.parameters()).device
    backend = backends.backend_name(backends.resolve(device, args.backend))
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: LLaMA architecture, {n_params / 1e6:.2f}M parameters, {args.dtype}, "
        f"{device}; optimizer: {args.optimizer}; kernels: {backend} backend"
    )

    if args.optimizer == "lomo":
        lr = 0.3 if args.lr is None else args.lr
        opt = Lomo(model, lr=lr, clip_grad_norm=args.clip_grad_norm, backend=args.backend)
    else:
        lr = 0.02 if args.lr is None else args.lr
        opt = AdaLomo(model, lr=lr, clip_grad_norm=args.clip_grad_norm, backend=args.backend)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps, eta_min=lr * 0.1)

    data = batches(args.seq, args.batch, args.seed)
    probe = next(batches(args.seq, 16, args.seed + 1))
    with torch.no_grad():
        start_loss = model(**probe).loss.item()
    tokens = 0
    began = time.perf_counter()
    bar = tqdm(range(args.steps), desc="fine-tuning", unit="step")
    for _ in bar:
        inputs = next(data)
        loss = model(**inputs).loss
        opt.fused_backward(loss)
        schedule.step()
        tokens += inputs["input_ids"].numel()
        bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{schedule.get_last_lr()[0]:.3g}")
    opt.flush_report()
    elapsed = time.perf_counter() - began
    with torch.no_grad():
        end_loss = model(**probe).loss.item()
    print(
        f"held-out windows: loss {start_loss:.3f} -> {end_loss:.3f}; "
        f"{tokens / elapsed:,.0f} tokens/s over {args.steps} steps ({elapsed:.1f} s)"
    )
    if getattr(opt, "loss_scaler", None) is not None:
        print(f"final fp16 loss scale: {opt.loss_scaler.scale.item():g}")
    if not end_loss < start_loss:
        raise SystemExit("the loss did not fall: something is wrong")
    return end_loss


if __name__ == "__main__":
    main()
