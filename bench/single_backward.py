"""Step time with single_backward=True against the exact two-pass mode (one process).

    python bench/single_backward.py [--device cpu|cuda] [--steps N] [--threads T] [--batch B]
        [--seq L] [--configs lomo-bf16 adalomo-bf16 lomo-fp16 lomo-fp32] [--json-out PATH]

A step is forward + `fused_backward` (for the exact mode that is the norm pass and the
update pass; for single_backward=True one backward). For each configuration the two modes
run on two copies of the same model, interleaved (exact, single, exact, single, ...), after
two warm-up steps each; the figure is the ratio of the median step times, as
MEASURING.md asks (absolute times on a shared machine vary, ratios taken in one run hold).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lomo_kernels import AdaLomo, Lomo  # noqa: E402

MODEL = {
    "vocab_size": 8000,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
# name: (label, optimizer, model dtype, keyword arguments). fp16 matmuls are very slow on
# CPU (seconds per step here): a figure for the overflow path, not a training speed.
CONFIGS = {
    "lomo-bf16": ("Lomo clip_grad_norm=1, bf16", Lomo, torch.bfloat16, {"clip_grad_norm": 1.0}),
    "adalomo-bf16": (
        "AdaLomo clip_grad_norm=1, bf16",
        AdaLomo,
        torch.bfloat16,
        {"clip_grad_norm": 1.0},
    ),
    "lomo-fp16": ("Lomo fp16 (loss scaling)", Lomo, torch.float16, {}),
    "lomo-fp32": ("Lomo clip_grad_norm=1, fp32", Lomo, torch.float32, {"clip_grad_norm": 1.0}),
}


def build(dtype: torch.dtype, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**MODEL)).to(device=device, dtype=dtype).train()


def synchronize(device: str) -> None:
    # CUDA work is asynchronous: a host clock read without this would time the launches only.
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run(config, steps: int, batch: int, seq: int, device: str = "cpu") -> dict:
    label, cls, dtype, kwargs = config
    base = build(dtype, device)
    runs = {}
    for single in (False, True):
        model = copy.deepcopy(base)
        opt = cls(model, lr=1e-3, single_backward=single, **kwargs)
        runs[single] = (model, opt, [])
    gen = torch.Generator().manual_seed(0)
    for step in range(steps + 2):
        ids = torch.randint(0, MODEL["vocab_size"], (batch, seq), generator=gen).to(device)
        for single in (False, True):
            model, opt, times = runs[single]
            synchronize(device)
            start = time.perf_counter()
            opt.fused_backward(model(input_ids=ids, labels=ids).loss)
            synchronize(device)
            elapsed = time.perf_counter() - start
            if step >= 2:
                times.append(elapsed)
    exact = statistics.median(runs[False][2])
    single = statistics.median(runs[True][2])
    return {
        "config": label,
        "exact_ms": exact * 1e3,
        "single_ms": single * 1e3,
        "ratio": single / exact,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    meta = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "threads": args.threads,
        "machine": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": MODEL,
        "batch": [args.batch, args.seq],
        "steps": args.steps,
    }
    shape = f"batch {args.batch}x{args.seq}"
    print(f"{meta['device']}, {args.threads} CPU thread(s), torch {torch.__version__}, {shape}, "
          f"median of {args.steps} interleaved steps")  # fmt: skip
    print(f"{'configuration':34} {'exact (ms)':>11} {'single (ms)':>12} {'single/exact':>13}")
    results = []
    for name in args.configs:
        r = run(CONFIGS[name], args.steps, args.batch, args.seq, args.device)
        results.append(r)
        print(f"{r['config']:34} {r['exact_ms']:11.1f} {r['single_ms']:12.1f} {r['ratio']:13.3f}")
    if args.json_out:
        args.json_out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
