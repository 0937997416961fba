"""LomoTrainer: transformers.Trainer training with lomo_kernels' optimizers."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from tiny_models import batch, tiny_llama

transformers = pytest.importorskip("transformers")
from transformers import Trainer, TrainingArguments  # noqa: E402

from lomo_kernels import Lomo  # noqa: E402
from lomo_kernels.integrations.hf_trainer import LomoTrainer  # noqa: E402


class RecordingTrainer(LomoTrainer):
    """Records the learning rate the optimizer holds at each step and each logged loss."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.seen_lrs = getattr(self, "seen_lrs", [])
        self.seen_lrs.append(self._lomo().param_groups[0]["lr"])
        return super().training_step(model, inputs, num_items_in_batch)


def dataset(n=8):
    fixed = batch(0, batch_size=1)
    return [{"input_ids": fixed["input_ids"][0], "labels": fixed["labels"][0]}] * n


def args(tmp_path, **overrides):
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
    return TrainingArguments(**base)


@pytest.mark.parametrize("optim", ["lomo", "adalomo"])
def test_trainer_trains_with_schedule_clip_and_decay(tmp_path, optim):
    model = tiny_llama()
    lr = 0.3 if optim == "lomo" else 0.05
    trainer = RecordingTrainer(
        model=model, args=args(tmp_path, optim=optim, learning_rate=lr), train_dataset=dataset()
    )
    trainer.train()
    opt = trainer._lomo()
    assert type(opt).__name__ == {"lomo": "Lomo", "adalomo": "AdaLomo"}[optim]
    assert opt.clip_grad_norm == 1.0
    assert opt.param_groups[0]["weight_decay"] == 0.01
    # Linear decay from lr to 0 over 12 steps: the optimizer used the scheduler's value.
    expected = [lr * (1 - k / 12) for k in range(12)]
    assert trainer.seen_lrs == pytest.approx(expected)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < losses[0] - 0.5


def test_trainer_refuses_gradient_accumulation(tmp_path):
    with pytest.raises(ValueError, match="gradient_accumulation_steps=4"):
        LomoTrainer(
            model=tiny_llama(),
            args=args(tmp_path, gradient_accumulation_steps=4),
            train_dataset=dataset(),
        )


def test_trainer_uses_a_given_optimizer(tmp_path):
    model = tiny_llama()
    opt = Lomo(model, lr=0.2, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    trainer = LomoTrainer(
        model=model,
        args=args(tmp_path, max_steps=3),
        train_dataset=dataset(),
        optimizers=(opt, sched),
    )
    trainer.train()
    assert trainer._lomo() is opt and opt.step_count == 3


def test_plain_trainer_with_lomo_explains_what_to_use(tmp_path):
    model = tiny_llama()
    opt = Lomo(model, lr=0.2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    trainer = Trainer(
        model=model,
        args=args(tmp_path, max_steps=2, optim="adamw_torch"),
        train_dataset=dataset(),
        optimizers=(opt, sched),
    )
    with pytest.raises(RuntimeError, match="LomoTrainer"):
        trainer.train()


def test_trainer_refuses_deepspeed_with_what_to_do(tmp_path):
    targs = args(tmp_path)
    targs.deepspeed = {"zero_optimization": {"stage": 3}}  # as TrainingArguments(deepspeed=...)
    with pytest.raises(ValueError, match="examples/zero3_finetune.py"):
        LomoTrainer(model=tiny_llama(), args=targs, train_dataset=dataset())


def fields_of(targs) -> dict:
    return {f.name: copy.deepcopy(getattr(targs, f.name)) for f in dataclasses.fields(targs)}


@pytest.mark.parametrize("positional", [False, True], ids=["args=", "positional"])
def test_trainer_leaves_the_callers_arguments_unchanged(tmp_path, positional):
    targs = args(tmp_path, max_steps=2)
    before = fields_of(targs)
    trainers = []
    for _ in range(2):  # the second trainer is built from the arguments the first one saw
        call = (
            ((tiny_llama(), targs), {})
            if positional
            else ((), {"model": tiny_llama(), "args": targs})
        )
        trainer = LomoTrainer(*call[0], **call[1], train_dataset=dataset())
        trainer.train()
        trainers.append(trainer)
    assert fields_of(targs) == before
    assert targs.max_grad_norm == 1.0
    for trainer in trainers:
        assert trainer.args is not targs and trainer.args.max_grad_norm == 0.0
        assert trainer._lomo().clip_grad_norm == 1.0
    first, second = ([h["loss"] for h in t.state.log_history if "loss" in h] for t in trainers)
    assert first == second  # same model, data and clipping: the same steps
