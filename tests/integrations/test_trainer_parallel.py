"""LomoTrainer's multi-process set-up checks that need no second process: the DeepSpeed
configs it refuses (given as a dict or as a file's path), before the Trainer reads anything
and before any parameter changes, and transformers' own Trainer with optim="lomo" under
DeepSpeed pointing to LomoTrainer. The 2-rank runs are in test_trainer_sharded.py."""

from __future__ import annotations

import json

import pytest
import torch
from support.dependencies import require
from support.models import tiny_llama

require("transformers")
from transformers import Trainer, TrainingArguments  # noqa: E402

import lomo_kernels  # noqa: E402
from lomo_kernels.integrations.hf_trainer import LomoTrainer  # noqa: E402

ZERO3 = {"zero_optimization": {"stage": 3}}
REFUSED = {
    "no zero section": ({"train_micro_batch_size_per_gpu": 2}, "zero_optimization.stage=0"),
    "stage 2": ({"zero_optimization": {"stage": 2}}, "needs stage 3"),
    "optimizer": ({**ZERO3, "optimizer": {"type": "AdamW"}}, "sets 'optimizer'"),
    "scheduler": ({**ZERO3, "scheduler": {"type": "WarmupLR"}}, "sets 'scheduler'"),
    "offload_param": (
        {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
        "zero_optimization.offload_param",
    ),
    "offload_optimizer": (
        {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}},
        "no DeepSpeed optimizer state to offload",
    ),
}


def args(tmp_path, optim="lomo"):
    return TrainingArguments(
        output_dir=str(tmp_path), optim=optim, use_cpu=True, report_to=[], max_steps=1
    )


@pytest.mark.parametrize("config, match", REFUSED.values(), ids=REFUSED.keys())
@pytest.mark.parametrize("form", ["dict", "file"])
def test_trainer_refuses_deepspeed_configs_it_cannot_train_under(tmp_path, config, match, form):
    model = tiny_llama()
    before = [p.clone() for p in model.parameters()]
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    targs = args(tmp_path)
    # As TrainingArguments(deepspeed=...) holds it (assigned after construction, so that no
    # DeepSpeed config is registered process-wide for the other tests of this process).
    targs.deepspeed = config if form == "dict" else str(path)
    with pytest.raises(ValueError, match=match):
        LomoTrainer(model=model, args=targs, train_dataset=[])
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))


def test_zero3_config_with_auto_values_is_accepted():
    from lomo_kernels.integrations.trainer_parallel import check_deepspeed_config

    check_deepspeed_config({**ZERO3, "train_micro_batch_size_per_gpu": "auto"})


def test_transformers_trainer_with_lomo_under_deepspeed_points_to_lomo_trainer(tmp_path):
    lomo_kernels.enable_transformers()
    try:
        targs = args(tmp_path)
        targs.deepspeed = ZERO3
        trainer = Trainer(model=tiny_llama(), args=targs, train_dataset=[])
        with pytest.raises(
            ValueError, match="Use lomo_kernels.integrations.hf_trainer.LomoTrainer"
        ):
            trainer.create_optimizer()
    finally:
        lomo_kernels.disable_transformers()
