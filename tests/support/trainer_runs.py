"""The LomoTrainer runs shared by the 2-rank ZeRO-3 worker and its one-process reference.

A transformers LLaMA with awkward sizes (97-token vocabulary, 73-wide MLP), a ZeRO-3 config
whose persistence threshold leaves the embedding, head and square projections partitioned and
the small tensors (norm weights, the 40 x 20 key/value projections) whole on every rank, and a
dataset of distinct rows taken in order: 2 ranks x 2 rows per step see the one process's 4 rows.
"""

from __future__ import annotations

import torch
from transformers import LlamaForCausalLM, TrainingArguments

from support.sharded_models import ScaledLlama

WORLD = 2
PER_RANK_BATCH = 2
STEPS = 3
SEQ = 9
VOCAB = 97
LR = {"lomo": 0.2, "adalomo": 0.05}
MAX_GRAD_NORM = 0.5  # below every step's norm: each step clips
WEIGHT_DECAY = 0.3
ZERO3 = {
    "train_micro_batch_size_per_gpu": "auto",
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1000},
}
# Each run: the optimizer and the optim_args it trains with.
RUNS = {
    "lomo": ("lomo", None),
    "adalomo": ("adalomo", None),
    "lomo_single": ("lomo", "single_backward=True"),
    "adalomo_single": ("adalomo", "single_backward=True"),
    "lomo_accumulate": ("lomo", None),
}
# The accumulating run: 2 micro-batches per step (4 rows each over the ranks), exact clipping
# by the accumulated gradients' norm; the 16 rows make 2 steps.
ACCUMULATE = {"gradient_accumulation_steps": 2, "max_steps": 2}


# The exact-clipping runs also evaluate after steps 2 and 3 (each rank half of the 8 rows):
# the engine's own forward runs between two training steps.
EVAL_ROWS = 8
EVAL = {"eval_strategy": "steps", "eval_steps": 2}


def llama(seed: int = 0) -> LlamaForCausalLM:
    """The sharded tests' LLaMA shape (sharded_models) with a 97-token vocabulary."""
    config = ScaledLlama.config()
    config.vocab_size = VOCAB
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def dataset(rows: int = 16) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=gen)
    return [{"input_ids": row, "labels": row} for row in ids]


def training_args(output_dir: str, run: str, **overrides) -> TrainingArguments:
    optim, optim_args = RUNS[run]
    base = dict(
        output_dir=output_dir,
        per_device_train_batch_size=PER_RANK_BATCH,
        # In order: step k takes rows 4k..4k+3, split 2 + 2 over the ranks.
        train_sampling_strategy="sequential",
        max_steps=STEPS,
        learning_rate=LR[optim],
        lr_scheduler_type="linear",
        weight_decay=WEIGHT_DECAY,
        max_grad_norm=MAX_GRAD_NORM,
        optim=optim,
        optim_args=optim_args,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    base.update(overrides)
    return TrainingArguments(**base)


def logged(trainer, key: str) -> list[float]:
    return [h[key] for h in trainer.state.log_history if key in h]


def logged_norms(trainer) -> list[float]:
    return logged(trainer, "grad_norm")
