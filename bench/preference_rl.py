"""`python -m bench.preference_rl`: peak memory of one TRL DPO step and one GRPO step per
configuration of the LM head and optimizer.

    python -m bench.preference_rl [--model llama-20m] [--batch B] [--prompt P]
                                  [--completion C] [--steps N] [--kinds dpo,grpo]
                                  [--configs fused_lomo,trl_lomo,trl_adamw] [--json F]

Configurations (each runs TRL's own trainer, fp32, on the CPU):

    fused_lomo  the model patched by `lomo_kernels.patch_causal_lm`, `enable_trl()`, Lomo:
                the log-probs (policy and reference) from the fused head, no logits, the
                head and embedding stepped in backward
    trl_lomo    TRL's own chunked head (`ChunkedLogProbFunction`), Lomo
    trl_adamw   TRL's own chunked head, torch's AdamW (transformers' ``adamw_torch``)

A DPO step: `batch` prompt/chosen/rejected triples of `prompt` + `completion` words (so
2 x batch sequences), scored by the policy and a reference model. A GRPO step: `batch`
completions of `completion` words generated for `batch / 2` prompts (2 generations each,
temperature 0.7), scored by the policy and a reference model (``beta=0.04``), one
generation per step. ``gradient_accumulation_steps=1``, clipping at 1.0.

Each configuration runs in a fresh process (`process.run_isolated`), as MEASURING.md says:
the figure is the process's VmHWM above its VmRSS once the trainer, the models and the data
exist, the max over the steps after the first (lazy optimizer state, first-call
allocations). MiB = 2**20 bytes. The target: fused_lomo's peak at most half of trl_adamw's.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from .common import machine
from .common.argtypes import (
    add_counts,
    add_json_argument,
    add_model_argument,
    comma_list,
    keyword_arguments,
    whole_number,
)
from .common.meter import MIB, Meter, require_metered_process
from .common.models import build_model, resolve_model
from .common.process import ProcessFailed, run_isolated

KINDS = ("dpo", "grpo")
CONFIGS = ("fused_lomo", "trl_lomo", "trl_adamw")
LABELS = {
    "fused_lomo": "fused head + Lomo",
    "trl_lomo": "TRL's chunked head + Lomo",
    "trl_adamw": "TRL's chunked head + AdamW",
}
THREADS = 2
TARGET = 0.5
TIMEOUT_S = 900


def _tokenizer(vocab: int) -> Any:
    """A word-level tokenizer of `vocab` words t0..t{vocab-1} (t0 pads, t1 ends)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1")


def _words(gen: Any, vocab: int, n: int) -> str:
    import torch

    return " ".join(f"t{j}" for j in torch.randint(2, vocab, (n,), generator=gen).tolist())


def _reward(completions: list[str], **_: Any) -> list[float]:
    """A rule with spread: how many words of the completion are in the lower half."""
    return [
        float(sum(int(w[1:]) < 16000 for w in c.split() if w[1:].isdigit())) for c in completions
    ]


def _trainer(
    folder: str,
    kind: str,
    config: str,
    model: str,
    batch: int,
    prompt: int,
    completion: int,
    steps: int,
    meter_callback: Any,
) -> tuple[Any, Any]:
    import datasets
    import torch
    from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer

    policy = build_model(model, "fp32", seed=0, fused_head=config == "fused_lomo")
    reference = build_model(model, "fp32", seed=0)
    vocab = policy.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    common = dict(
        output_dir=folder,
        optim="lomo" if config.endswith("lomo") else "adamw_torch",
        learning_rate=1e-5,
        max_grad_norm=1.0,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        max_steps=steps,
        bf16=False,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    if kind == "dpo":
        rows = [
            {
                "prompt": _words(gen, vocab, prompt),
                "chosen": _words(gen, vocab, completion),
                "rejected": _words(gen, vocab, completion),
            }
            for _ in range(batch * steps)
        ]
        return policy, DPOTrainer(
            model=policy,
            ref_model=reference,
            args=DPOConfig(**common, max_length=prompt + completion + 2),
            train_dataset=datasets.Dataset.from_list(rows),
            processing_class=_tokenizer(vocab),
            callbacks=[meter_callback],
        )
    # GRPO builds its reference model from the policy's config path: give it one on disk.
    path = f"{folder}/start"
    reference.save_pretrained(path)
    policy.config._name_or_path = path
    rows = [{"prompt": _words(gen, vocab, prompt)} for _ in range(batch * steps)]
    args = GRPOConfig(
        **common,
        num_generations=2,
        max_completion_length=completion,
        steps_per_generation=1,
        temperature=0.7,
        beta=0.04,
    )
    return policy, GRPOTrainer(
        model=policy,
        reward_funcs=_reward,
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=_tokenizer(vocab),
        callbacks=[meter_callback],
    )


def measure(
    kind: str,
    config: str,
    model: str = "llama-20m",
    batch: int = 4,
    prompt: int = 64,
    completion: int = 192,
    steps: int = 3,
) -> dict[str, Any]:
    """Runs `kind` (dpo, grpo) under `config` in this process; its figures (module
    docstring)."""
    require_metered_process()
    if steps < 2:
        raise ValueError("steps must be >= 2: step 0 is not measured")
    import datasets
    import torch
    import transformers
    import trl
    from transformers import TrainerCallback

    import lomo_kernels

    torch.set_num_threads(THREADS)
    datasets.disable_progress_bars()
    meter = Meter("cpu")
    peaks: list[int] = []

    class PeakPerStep(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            meter.reset_peak()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step > 1:  # step 0's lazy state and first calls not measured
                peaks.append(meter.peak() - baseline)

    lomo_kernels.enable_trl()
    folder = tempfile.TemporaryDirectory(prefix="bench_preference_rl_")
    try:
        policy, trainer = _trainer(
            folder.name, kind, config, model, batch, prompt, completion, steps, PeakPerStep()
        )
        # Whether autograd ever forms the head's whole gradient (a .grad read after training
        # cannot say: Lomo frees every gradient once used).
        head_gradients: list[bool] = []
        policy.lm_head.weight.register_hook(
            lambda grad: None if grad is None else head_gradients.append(True)
        )
        baseline = meter.current()
        trainer.train()
    finally:
        lomo_kernels.disable_trl()
        folder.cleanup()
    return {
        "kind": kind,
        "config": config,
        "model": resolve_model(model).name,
        "vocab": policy.config.vocab_size,
        "batch": batch,
        "prompt": prompt,
        "completion": completion,
        "steps": steps,
        "model_mb": sum(p.numel() * p.element_size() for p in policy.parameters()) / MIB,
        "peaks_mb": [p / MIB for p in peaks],
        "peak_above_start_mb": max(peaks) / MIB,
        "head_grad_exists": bool(head_gradients),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
    }


def run(
    kinds: Sequence[str],
    configs: Sequence[str],
    model: str = "llama-20m",
    batch: int = 4,
    prompt: int = 64,
    completion: int = 192,
    steps: int = 3,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every (kind, config) in its own process: (results, machine)."""
    results = []
    for kind in kinds:
        for config in configs:
            settings = dict(
                kind=kind,
                config=config,
                model=model,
                batch=batch,
                prompt=prompt,
                completion=completion,
                steps=steps,
            )
            try:
                results.append(
                    run_isolated(measure, settings, timeout=TIMEOUT_S, what=f"{kind} {config}")
                )
            except ProcessFailed as error:
                results.append({"kind": kind, "config": config, "error": str(error)})
    return results, machine.describe("cpu")


def format_table(results: Sequence[dict[str, Any]]) -> str:
    """One row per (kind, config): the peak above the step's start and its ratio to TRL's
    head with AdamW; a last line per kind on the target."""
    lines = [
        "| step | configuration | peak above start (MiB) | / TRL's head + AdamW |",
        "|---|---|---|---|",
    ]
    verdicts = []
    for kind in KINDS:
        rows = [r for r in results if r["kind"] == kind]
        adamw = next((r for r in rows if r["config"] == "trl_adamw" and "error" not in r), None)
        for r in rows:
            if "error" in r:
                lines.append(f"| {kind.upper()} | {LABELS[r['config']]} | error | |")
                continue
            ratio = (
                f"{r['peak_above_start_mb'] / adamw['peak_above_start_mb']:.2f}x" if adamw else ""
            )
            peak = r["peak_above_start_mb"]
            lines.append(f"| {kind.upper()} | {LABELS[r['config']]} | {peak:.0f} | {ratio} |")
        fused = next((r for r in rows if r["config"] == "fused_lomo" and "error" not in r), None)
        if fused and adamw:
            ratio = fused["peak_above_start_mb"] / adamw["peak_above_start_mb"]
            met = "met" if ratio <= TARGET else "NOT met"
            verdicts.append(
                f"{kind.upper()}: fused head + Lomo at {ratio:.2f}x (target <= {TARGET}x: {met})"
            )
    first = next((r for r in results if "error" not in r), None)
    if first:
        lines.insert(
            0,
            f"{first['model']} (vocabulary {first['vocab']}), fp32, batch {first['batch']}, "
            f"prompt {first['prompt']} + completion {first['completion']} words, "
            f"{first['steps']} steps (step 0 not measured)\n",
        )
    return "\n".join(lines + [""] + verdicts)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser, "llama-20m")
    add_counts(parser, batch=4, prompt=64, completion=192)
    parser.add_argument(
        "--steps", type=whole_number(2), default=3, help="steps per process (step 0 skipped)"
    )
    parser.add_argument("--kinds", type=comma_list(KINDS), default=list(KINDS))
    parser.add_argument("--configs", type=comma_list(CONFIGS), default=list(CONFIGS))
    add_json_argument(parser)


def command(args: argparse.Namespace) -> int:
    if args.batch % 2:
        raise SystemExit("--batch must be even (GRPO makes 2 generations per prompt)")
    results, meta = run(**keyword_arguments(args, run))
    machine.print_results(meta, format_table(results), args.json, results=results)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    from bench.common.cli import main

    sys.exit(main(__spec__.name))
