"""DPO with Lomo teaches the demo's pretrained character model to prefer right sums.

    python examples/dpo_arithmetic.py [--steps 80] [--plot dpo.png]

Pairs from the corpus's sums ("seven plus five is"): the right number word chosen
(" twelve."), a wrong one rejected (two per sum, drawn at random from the other number
words, from a seed). TRL's DPOTrainer trains the pretrained character-level LLaMA (0.8M parameters,
bench/data/, which has seen no sums) with `optim="lomo"` against a frozen copy of it as the
reference, with gradient accumulation over two micro-batches per step. Each step's
preference accuracy (the share of pairs whose chosen completion gets the larger DPO reward)
and reward margin are printed and plotted where matplotlib is installed. Before and after,
the held-out accuracy, the share of pairs whose chosen completion the model itself makes
more likely than the rejected one: on the sums the corpus holds out (never trained on), and
on the training sums with wrong answers not trained on.
Weights are bf16 where the CPU multiplies bf16 natively, fp32 elsewhere (`--dtype`).
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import tempfile
from typing import Any

from arithmetic_common import (
    Clock,
    Problem,
    char_tokenizer,
    common_run_args,
    completion_log_probs,
    logged,
    plot_curves,
    pretrained_model,
    problem,
    task_sentences,
    weights_dtype,
)

import lomo_kernels
from bench.data.make_corpus import WORDS
from lomo_kernels.tools.argtypes import positive_int

LEARNING_RATE = 0.3  # of 0.3 and 1.0 at this batch, the steadier rise of the margin
BETA = 0.1  # TRL's default


def pairs(problems: list[Problem], seed: int, per_problem: int = 1) -> list[dict[str, str]]:
    """DPO rows: each problem's right answer chosen, `per_problem` wrong ones rejected."""
    rng = random.Random(seed)
    rows = []
    for p in problems:
        wrong = [w for w in WORDS if w != p.answer]
        for w in rng.sample(wrong, per_problem):
            rows.append({"prompt": p.prompt, "chosen": f" {p.answer}.", "rejected": f" {w}."})
    return rows


def held_out_accuracy(model: Any, rows: list[dict[str, str]]) -> float:
    """The share of rows whose chosen completion the model makes more likely than the
    rejected one (summed log-probabilities, the closing line end included)."""
    prompts = [r["prompt"] for r in rows]
    chosen = completion_log_probs(model, prompts, [r["chosen"] for r in rows])
    rejected = completion_log_probs(model, prompts, [r["rejected"] for r in rows])
    return float((chosen > rejected).float().mean())


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=positive_int, default=80)
    parser.add_argument("--lr", type=float, default=LEARNING_RATE)
    parser.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default="dpo_arithmetic.png", help="PNG ('': none)")
    parser.add_argument("--json", default="", help="write the curves here")
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import datasets
    from transformers import PrinterCallback
    from trl import DPOConfig, DPOTrainer

    args = arguments().parse_args(argv)
    datasets.disable_progress_bars()
    clock = Clock()
    dtype = weights_dtype(args.dtype)
    train, held = task_sentences(max_sum=len(WORDS) - 1)  # every sum of the corpus
    train_problems = [problem(s) for s in train]
    train_rows = pairs(train_problems, args.seed, per_problem=2)
    held_rows = pairs([problem(s) for s in held], args.seed + 1, per_problem=4)
    # The training sums with other wrong answers: pairs not trained on, facts trained on.
    unseen = [r for r in pairs(train_problems, args.seed + 2, per_problem=2) if r not in train_rows]
    model = pretrained_model(dtype)
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    before = held_out_accuracy(model, held_rows)
    before_unseen = held_out_accuracy(model, unseen)
    config = DPOConfig(
        **common_run_args(tempfile.mkdtemp(prefix="dpo_"), args.steps, args.seed),
        optim="lomo",
        learning_rate=args.lr,
        per_device_train_batch_size=16,
        gradient_accumulation_steps=2,
        beta=BETA,
        dataloader_drop_last=True,  # every step the same number of pairs
    )
    lomo_kernels.enable_trl()
    try:
        trainer = DPOTrainer(
            model=model,
            ref_model=reference,
            args=config,
            train_dataset=datasets.Dataset.from_list(train_rows),
            processing_class=char_tokenizer(),
        )
        trainer.remove_callback(PrinterCallback)  # the curves are printed once, below
        trainer.train()
    finally:
        lomo_kernels.disable_trl()
    after = held_out_accuracy(model, held_rows)
    after_unseen = held_out_accuracy(model, unseen)
    curves = {
        "accuracy": logged(trainer, "rewards/accuracies"),
        "margin": logged(trainer, "rewards/margins"),
    }
    print(f"DPO with lomo (lr {args.lr:g}, beta {BETA:g}), {str(dtype)[6:]} weights, "
          f"{len(train_rows)} training pairs")  # fmt: skip
    print("preference accuracy per step\n  " + " ".join(f"{a:.2f}" for a in curves["accuracy"]))
    print("reward margin per step\n  " + " ".join(f"{m:.3f}" for m in curves["margin"]))
    k = max(1, args.steps // 5)  # first and last fifth: one step's figure is noisy
    for name, curve in curves.items():
        start, end = sum(curve[:k]) / k, sum(curve[-k:]) / k
        print(f"{name}: {start:.2f} over the first {k} step(s), {end:.2f} over the last {k}")
    print(f"held-out accuracy ({len(held_rows)} pairs on {len(held)} held-out sums): "
          f"{before:.2f} before, {after:.2f} after")  # fmt: skip
    print(f"unseen pairs on the training sums ({len(unseen)}): {before_unseen:.2f} before, "
          f"{after_unseen:.2f} after")  # fmt: skip
    print(f"done in {clock.line()}")
    if args.plot and plot_curves(
        curves,
        args.plot,
        "preference accuracy / reward margin",
        f"DPO on sums with Lomo, {str(dtype)[6:]} weights, character LLaMA 0.8M (CPU)",
    ):
        print(f"plot: {args.plot}")
    result = {**curves, "held_out_before": before, "held_out_after": after}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)
    return result


if __name__ == "__main__":
    main()
