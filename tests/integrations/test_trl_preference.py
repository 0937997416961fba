"""TRL's DPOTrainer, GRPOTrainer and RLOOTrainer with Lomo and gradient accumulation against
the same trainers with torch's SGD; the unchecked trainers refused by name before any change
(a patched model in these trainers: test_trl_fused_head.py)."""

from __future__ import annotations

import pytest
import torch
from support.models import max_rel_diff

import lomo_kernels

try:  # a test dependency, as in test_trl.py
    import datasets
    from test_trl import CPU_RUN, llama, tokenizer
    from test_trl import trl as trl  # the fixture requiring TRL, shared
    from trl import (
        DPOConfig,
        DPOTrainer,
        GRPOConfig,
        GRPOTrainer,
        KTOConfig,
        KTOTrainer,
        RLOOConfig,
        RLOOTrainer,
    )

    from lomo_kernels.integrations.huggingface import in_backward_optimizer
except ImportError:
    DPOTrainer = None


STEPS = 2
# The suite's fp32 bound for Lomo against torch.optim.SGD: 1e-6 of each tensor (the runs
# differ in the order of the clipping norm's reduction and of the update's rounding only).
# AdaLomo against its own big-batch step is held to it too: the reason is in that test.
SGD_RTOL = 1e-6


def words(gen, n):
    return " ".join(f"t{j}" for j in torch.randint(2, 96, (n,), generator=gen).tolist())


def pairs(n=8):
    gen = torch.Generator().manual_seed(0)
    return datasets.Dataset.from_list(
        [
            {
                "prompt": words(gen, 3),
                "chosen": words(gen, 3 + i % 3),
                "rejected": words(gen, 2 + i % 4),
            }
            for i in range(n)
        ]
    )


def prompts(n=8):
    return datasets.Dataset.from_list([{"prompt": f"t{3 + i} t{4 + i} t{5 + i}"} for i in range(n)])


def reward(completions, **_):
    """A rule: how often the completion says t5."""
    return [float(c.split().count("t5")) for c in completions]


COMMON = dict(
    CPU_RUN,
    per_device_train_batch_size=2,
    gradient_accumulation_steps=2,
    max_steps=STEPS,
    learning_rate=0.05,
    max_grad_norm=1.0,
)
# GRPO/RLOO: two generations per prompt, each generation batch reused for 4 micro-batches
# (steps_per_generation) and twice (num_iterations), so the importance ratio is TRL's own.
RL = dict(num_generations=2, max_completion_length=6, steps_per_generation=4, num_iterations=2)


def build(kind, tmp_path, optim, patch=False, **overrides):
    model = llama()
    if patch:
        lomo_kernels.patch_causal_lm(model)
    args = dict(COMMON, output_dir=str(tmp_path), optim=optim, **overrides)
    if kind == "dpo":
        return model, DPOTrainer(
            model=model,
            ref_model=llama(),
            args=DPOConfig(**args),
            train_dataset=pairs(),
            processing_class=tokenizer(),
        )
    config, trainer = {"grpo": (GRPOConfig, GRPOTrainer), "rloo": (RLOOConfig, RLOOTrainer)}[kind]
    if kind == "rloo":
        args["beta"] = 0.0  # a KL term would load a reference model from the hub by name
    return model, trainer(
        model=model,
        reward_funcs=reward,
        args=config(**args, **RL),
        train_dataset=prompts(),
        processing_class=tokenizer(),
    )


def trained(kind, tmp_path, optim, **overrides):
    lomo_kernels.enable_trl()
    try:
        model, trainer = build(kind, tmp_path, optim, **overrides)
        trainer.train()
    finally:
        lomo_kernels.disable_trl()
    return model, trainer


def logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


# Each run's max_grad_norm: below every step's norm before clipping but GRPO/RLOO's first
# (0: the first iteration's importance ratio is 1), so the clip binds on the steps the
# 2nd micro-batch closes in backward (DPO's norms are 0.54-0.57, under the default 1.0).
ACCUMULATED_CLIP = {"dpo": 0.25, "grpo": 1.0, "rloo": 1.0}


@pytest.mark.parametrize("kind", ["dpo", "grpo", "rloo"])
def test_preference_and_rl_trainers_accumulate_as_with_torchs_sgd(tmp_path, kind):
    """2 steps of 2 micro-batches, clipped (GRPO/RLOO: generations reused over 4
    micro-batches and 2 iterations; the same seed gives both runs the same completions):
    the parameters within SGD_RTOL of torch's SGD run, the losses and norms equal to it
    within the same bound."""
    clip = ACCUMULATED_CLIP[kind]
    model, trainer = trained(kind, tmp_path / "lomo", "lomo", max_grad_norm=clip)
    reference, sgd = trained(kind, tmp_path / "sgd", "sgd", max_grad_norm=clip)
    # torch's norms before clipping: the clip binds on every step with a gradient.
    assert all(n == 0.0 or n > clip for n in logged(sgd, "grad_norm"))
    opt = in_backward_optimizer(trainer.optimizer)
    assert type(opt).__name__ == "Lomo"
    assert opt.accumulation_steps == 2 and opt.step_count == STEPS
    assert logged(trainer, "loss") == pytest.approx(logged(sgd, "loss"), rel=SGD_RTOL, abs=1e-9)
    norms = logged(trainer, "grad_norm")
    assert norms == pytest.approx(logged(sgd, "grad_norm"), rel=SGD_RTOL) and max(norms) > 0
    assert max_rel_diff(model, reference) <= SGD_RTOL
    assert max_rel_diff(model, llama()) > 1e-4  # it trained


def test_adalomo_dpo_accumulation_equals_its_big_batch_step(tmp_path):
    """AdaLomo in DPO, 2 micro-batches of 2 pairs per step, against AdaLomo on the same 4
    pairs at once (the sampler's order is the same): AdaLomo's factored second moment of the
    accumulated gradient is the big batch's, so the runs agree within the suite's fp32 bound
    (AdaLomo's update is normalised by its RMS: a rounding-level change of the gradient moves
    it by a rounding-level relative amount), the clip binding at every step."""
    run = dict(learning_rate=1e-2, max_grad_norm=0.3)
    model, trainer = trained("dpo", tmp_path / "k2", "adalomo", **run)
    at_once = dict(run, per_device_train_batch_size=4, gradient_accumulation_steps=1)
    big, big_trainer = trained("dpo", tmp_path / "k1", "adalomo", **at_once)
    opt = in_backward_optimizer(trainer.optimizer)
    assert type(opt).__name__ == "AdaLomo" and opt.accumulation_steps == 2
    assert opt.step_count == STEPS
    norms = logged(trainer, "grad_norm")
    assert norms == pytest.approx(logged(big_trainer, "grad_norm"), rel=SGD_RTOL)
    assert min(norms) > 0.3  # clipped
    assert logged(trainer, "loss") == pytest.approx(logged(big_trainer, "loss"), rel=SGD_RTOL)
    assert max_rel_diff(model, big) <= SGD_RTOL
    assert max_rel_diff(model, llama()) > 1e-4  # it trained


def test_adalomo_trains_grpo_with_accumulation(tmp_path):
    # GRPO samples its completions, so a run of another batch shape draws others: no
    # big-batch twin here. What is checked: the steps run, counted per step, and train.
    model, trainer = trained("grpo", tmp_path, "adalomo", learning_rate=1e-2)
    opt = in_backward_optimizer(trainer.optimizer)
    assert type(opt).__name__ == "AdaLomo" and opt.accumulation_steps == 2
    assert opt.step_count == STEPS
    assert max_rel_diff(model, llama()) > 1e-4


def test_kto_trainer_is_refused_by_name(tmp_path):
    data = datasets.Dataset.from_list(
        [{"prompt": "t3 t4", "completion": "t5 t6", "label": i % 2 == 0} for i in range(4)]
    )
    lomo_kernels.enable_trl()
    try:
        trainer = KTOTrainer(
            model=llama(),
            ref_model=llama(),
            args=KTOConfig(**COMMON, output_dir=str(tmp_path), optim="lomo"),
            train_dataset=data,
            processing_class=tokenizer(),
        )
        with pytest.raises(ValueError, match="KTOTrainer.*not supported"):
            trainer.create_optimizer()
    finally:
        lomo_kernels.disable_trl()


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("trl", "KTOTrainer"),
        ("trl", "DistillationTrainer"),
        ("trl", "RewardTrainer"),
        ("trl.experimental.orpo", "ORPOTrainer"),
        ("trl.experimental.cpo", "CPOTrainer"),
        ("trl.experimental.online_dpo", "OnlineDPOTrainer"),
        ("trl.experimental.gkd", "GKDTrainer"),  # an SFTTrainer subclass of TRL's own
    ],
)
def test_every_other_trl_trainer_is_refused_by_name(module, name):
    """Every trainer TRL defines besides SFT, DPO, GRPO and RLOO is refused with Lomo/AdaLomo
    when it builds its optimizer (`create_optimizer`, which transformers' Trainer runs for
    all of them), before the optimizer exists; with another optimizer it is left alone. A
    user's own subclass of a served trainer is served."""
    import importlib
    import types

    from lomo_kernels.integrations.trl_trainers import check_trl_trainer

    def bare(cls, optim):  # the check reads the class and args.optim only
        trainer = cls.__new__(cls)
        trainer.args = types.SimpleNamespace(optim=optim)
        return trainer

    cls = getattr(importlib.import_module(module), name)
    for optim in ("lomo", "adalomo"):
        with pytest.raises(ValueError, match=rf"TRL's {name} with optim='{optim}' is not supp"):
            check_trl_trainer(bare(cls, optim))
    check_trl_trainer(bare(cls, "sgd"))
    mine = type("MyTrainer", (cls,), {})
    with pytest.raises(ValueError, match=rf"MyTrainer \(a {name}\)"):
        check_trl_trainer(bare(mine, "lomo"))
    check_trl_trainer(bare(type("MyDPO", (DPOTrainer,), {}), "lomo"))
