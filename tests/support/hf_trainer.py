"""The transformers Trainer set-up shared by the LomoTrainer and enable_transformers tests:
a one-row dataset, CPU training arguments and the logged values."""

from __future__ import annotations

import pytest
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


def no_decay_on_norms(model: torch.nn.Module) -> list[dict]:
    """The Trainer's split (a LLaMA has no bias): the RMSNorm weights without decay."""
    return [{"params": sorted(norm_weight_names(model)), "weight_decay": 0.0}]


def assert_skipped_steps_hold_the_warmup(steps: list, lr: float, warmup: int) -> None:
    """`steps`: each step's (lr it ran with, whether the optimizer skipped it). Some steps
    were skipped, some applied, and each ran at transformers' own linear warm-up schedule
    (evaluated here, independently of the run) for the steps applied before it: a skipped
    step held the schedule, as after a step torch's GradScaler skips."""
    skipped = [was_skipped for _, was_skipped in steps]
    assert 0 < sum(skipped) < len(steps)  # some steps overflowed, some did not
    schedule = transformers.get_linear_schedule_with_warmup(
        torch.optim.SGD([torch.zeros(1)], lr=lr), warmup, len(steps)
    ).lr_lambdas[0]
    applied_before = [sum(1 for s in skipped[:k] if not s) for k in range(len(steps))]
    expected = [lr * schedule(n) for n in applied_before]
    assert [step_lr for step_lr, _ in steps] == pytest.approx(expected, rel=1e-12)


class RecordsMicroBatches:
    """A Trainer mixin recording each micro-batch its training step takes, in
    `micro_batches`: (the step it belongs to, the Trainer's global_step as it runs; its
    inputs; the step's item count, which the model divides the summed loss by)."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.micro_batches = getattr(self, "micro_batches", [])
        self.micro_batches.append((self.state.global_step, dict(inputs), num_items_in_batch))
        return super().training_step(model, inputs, num_items_in_batch)


def replay(model, opt, micro_batches) -> list[float]:
    """An accumulating optimizer's own loop on a Trainer's recorded micro-batches
    (`RecordsMicroBatches`): each loss as the Trainer computes it, a step that the k-th
    micro-batch does not close (short or carried) applied by opt.step() where the Trainer's
    sync step applies it. Returns each step's norm (clipping on)."""
    norms = []
    for i, (step, inputs, num_items) in enumerate(micro_batches):
        opt.fused_backward(model(**inputs, num_items_in_batch=num_items).loss)
        if i + 1 == len(micro_batches) or micro_batches[i + 1][0] != step:  # the step ends
            if opt.pending_micro_batches:
                opt.step()
            norms.append(float(opt.last_grad_norm))
    return norms


def big_batches(micro_batches) -> list[dict[str, torch.Tensor]]:
    """Each step's recorded micro-batches (`RecordsMicroBatches`) concatenated into its big
    batch (for rows of one length, whose mean loss is the sum of the Trainer's
    per-micro-batch losses, each divided by the step's item count)."""
    steps: dict[int, list[dict[str, torch.Tensor]]] = {}
    for step, inputs, _ in micro_batches:
        steps.setdefault(step, []).append(inputs)
    return [
        {key: torch.cat([inputs[key] for inputs in step]) for key in step[0]}
        for _, step in sorted(steps.items())
    ]
