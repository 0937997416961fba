"""The optimizer's options together under ZeRO-3 and FSDP2 on 2 ranks (torchrun, gloo, CPU)
against one process on the full batch: the head tied to the embedding, the first decoder
layer frozen, a param group with its own lr and no decay, clipping by value and by norm
together, with a norm pass per step and with accumulation (and reentrant activation
checkpointing, which the reference runs without: the recomputed forward is the same), and the
checkpoint of the first loaded in one process (options_worker.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.dependencies import require
from support.sharded_checks import OPTIMIZERS, assert_within_update_tolerance, rank_run_fixtures
from support.sharded_models import (
    FROZEN,
    LR,
    STEPS,
    TRAININGS,
    TiedScaledLlama,
    combined_options,
    freeze_first_layer,
    global_batch,
)
from support.state import assert_same_state

import lomo_kernels

deepspeed = require("deepspeed")

WORKER = Path(__file__).parent / "options_worker.py"

options_run, checks = rank_run_fixtures(WORKER, "sharded options", "options_run")


def one_process(name: str, training: str, initial: dict, **changes):
    """The run of options_worker.py in this process on the full batch, from `initial`, with
    `changes` to its options: (model, optimizer)."""
    model = TiedScaledLlama()
    model.load_state_dict(initial)
    freeze_first_layer(model)
    options = combined_options(model, name, accumulate=training == "accumulating", **changes)
    opt = OPTIMIZERS[name](model, lr=LR[name], **options)
    TRAININGS[training](model, opt, global_batch)
    return model, opt


def trained(state: dict) -> dict:
    return {name: value for name, value in state.items() if not name.startswith(FROZEN)}


@pytest.mark.slow
@pytest.mark.parametrize("training", TRAININGS)
@pytest.mark.parametrize("name", ["lomo", "adalomo"])
@pytest.mark.parametrize("engine", ["zero3", "fsdp2"])
def test_combined_options_equal_one_process(options_run, checks, engine, name, training):
    key = f"{engine}_{name}_{training}"
    saved = torch.load(options_run / f"{key}.pt")
    initial, final = saved["initial"], saved["final"]
    model, opt = one_process(name, training, initial)
    steps = STEPS + (training == "accumulating")  # the short step applied by opt.step()
    assert opt.step_count == steps
    assert [rank[key]["step_count"] for rank in checks] == [steps] * len(checks)
    recomputed = training == "accumulating"
    assert [rank[key]["recomputed"] for rank in checks] == [recomputed] * len(checks)
    frozen = [name for name in initial if name.startswith(FROZEN)]
    assert frozen and all(torch.equal(final[name], initial[name]) for name in frozen)
    reference = model.state_dict()
    assert reference.keys() == final.keys()
    assert_within_update_tolerance(trained(final), trained(reference), initial)
    # Each clip binds, so a rank that left either out would fail the comparison above.
    assert float(opt.clip_coef) < 1.0
    unclamped, _ = one_process(name, training, initial, clip_grad_value=None)
    with pytest.raises(AssertionError, match="over bound"):
        assert_within_update_tolerance(trained(unclamped.state_dict()), trained(reference), initial)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lomo", "adalomo"])
@pytest.mark.parametrize("engine", ["zero3", "fsdp2"])
def test_checkpoint_of_combined_options_resumes_in_one_process(options_run, engine, name):
    """The sharded run's checkpoint (the head tied to the embedding: ZeRO-3 saves it once,
    under its first name) loads into one process as the consolidated state does, and the
    next step from it is that one's, bit for bit."""
    key = f"{engine}_{name}_per_step"
    saved = torch.load(options_run / f"{key}.pt")

    def resumed(load) -> tuple:
        model = TiedScaledLlama()
        freeze_first_layer(model)
        options = combined_options(model, name, accumulate=False)
        opt = OPTIMIZERS[name](model, lr=LR[name], **options)
        load(model, opt)
        state = {"model": clone_state(model), "optimizer": opt.state_dict()}
        TRAININGS["per_step"](model, opt, lambda step: global_batch(STEPS + step), 1)
        return state, {"model": model.state_dict(), "optimizer": opt.state_dict()}

    def consolidated(model, opt) -> None:
        model.load_state_dict(saved["final"])
        opt.load_state_dict(saved["optimizer"])

    from_checkpoint = resumed(
        lambda model, opt: lomo_kernels.load_checkpoint(
            options_run / f"{key}_checkpoint", model, opt
        )
    )
    expected = resumed(consolidated)
    assert_same_state(from_checkpoint[0]["model"], saved["final"])
    assert_same_state(from_checkpoint, expected)


def clone_state(model) -> dict:
    return {name: value.clone() for name, value in model.state_dict().items()}
