"""The transformers Trainer set-up shared by the LomoTrainer and enable_transformers tests:
a one-row dataset, CPU training arguments and the logged values."""

from __future__ import annotations

import torch

from support.dependencies import require
from support.models import batch

transformers = require("transformers")


def dataset(n: int = 8) -> list[dict[str, torch.Tensor]]:
    """`n` copies of one training row (input ids and labels)."""
    fixed = batch(0, batch_size=1)
    return [{"input_ids": fixed["input_ids"][0], "labels": fixed["labels"][0]}] * n


def distinct_rows(n: int) -> list[dict[str, torch.Tensor]]:
    """`n` different training rows (so that micro-batches differ)."""
    rows = batch(1, batch_size=n)
    return [{"input_ids": rows["input_ids"][i], "labels": rows["labels"][i]} for i in range(n)]


def trainer_batch() -> dict[str, torch.Tensor]:
    """The batch the Trainer forms from `dataset`: two copies of one sequence."""
    rows = dataset(2)
    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}


def logged(trainer, key: str = "grad_norm") -> list[float]:
    """The values of `key` in the Trainer's log, step by step."""
    return [h[key] for h in trainer.state.log_history if key in h]


def args(tmp_path, **overrides) -> transformers.TrainingArguments:
    """CPU TrainingArguments for 12 logged steps of Lomo with a linear schedule, decay and
    clipping; `overrides` replace any of them."""
    base = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_steps=12,
        learning_rate=0.3,
        lr_scheduler_type="linear",
        weight_decay=0.01,
        max_grad_norm=1.0,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        use_cpu=True,
        optim="lomo",
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    base.update(overrides)
    return transformers.TrainingArguments(**base)


def norm_weight_names(model: torch.nn.Module) -> set[str]:
    """The names of the RMSNorm weights (the parameters Trainer does not decay)."""
    return {n for n, _ in model.named_parameters() if "norm" in n}
