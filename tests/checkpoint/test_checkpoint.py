"""Checkpoints in one process: lomo_kernels.save_checkpoint / load_checkpoint and torch's own
torch.distributed.checkpoint API with Lomo and AdaLomo, on transformers LLaMA.

A resumed run must equal the uninterrupted one bit for bit (one process is deterministic and
the checkpoint holds every value the next steps read). Refusals must leave the parameters and
the optimizer's state exactly as they were. The 2-rank cases are in
tests/distributed/test_sharded_checkpoint.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from support.models import batch, tiny_llama
from support.state import (
    assert_refused,
    assert_same_state,
    assert_unchanged_since,
    optimizer_snapshot,
)
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from lomo_kernels import AdaLomo, CheckpointError, Lomo, load_checkpoint, save_checkpoint
from lomo_kernels.checkpoint import MANIFEST
from lomo_kernels.checkpoint.state import without_unsaved_aliases

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

# (class, options, parameter dtype): two passes with clipping; fp16 with the dynamic loss
# scaler; AdaLomo's moments with the single-backward norm history; bf16 stochastic rounding,
# whose seed follows the step count; AdaLomo's moments over two param groups.
SETUPS = {
    "lomo": (Lomo, {"lr": 0.05, "clip_grad_norm": 1.0, "weight_decay": 0.01}, torch.float32),
    "lomo_fp16": (Lomo, {"lr": 0.05}, torch.float16),
    "adalomo_single": (
        AdaLomo,
        {"lr": 0.01, "clip_grad_norm": 1.0, "single_backward": True},
        torch.float32,
    ),
    "adalomo_bf16": (AdaLomo, {"lr": 0.01}, torch.bfloat16),
    # Two param groups: torch's state_dict API keys the state by name, group by group.
    "adalomo_groups": (
        AdaLomo,
        {
            "lr": 0.01,
            "param_groups": [
                {"params": ["model.norm.weight", "lm_head.weight"], "weight_decay": 0.0}
            ],
            "weight_decay": 0.01,
        },
        torch.float32,
    ),
}
STEPS, SAVE_AT = 4, 2


def build(setup: str, seed: int = 0, **options):
    cls, own, dtype = SETUPS[setup]
    model = tiny_llama(dtype, seed=seed)
    return model, cls(model, **{**own, **options})


def step(model, opt, index: int) -> None:
    if opt.clip_grad_norm is not None and not opt.single_backward:
        opt.grad_norm(model(**batch(index)).loss)
    opt.fused_backward(model(**batch(index)).loss)


def state_of(model, opt) -> dict:
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "opt": opt.state_dict(),
    }


def uninterrupted(setup: str) -> dict:
    model, opt = build(setup)
    for index in range(STEPS):
        step(model, opt, index)
    return state_of(model, opt)


@pytest.mark.parametrize("setup", SETUPS)
def test_save_and_resume_equals_uninterrupted(setup, tmp_path):
    model, opt = build(setup)
    for index in range(SAVE_AT):
        step(model, opt, index)
    save_checkpoint(tmp_path / "ckpt", model, opt, client_state={"step": SAVE_AT})
    assert (tmp_path / "ckpt" / MANIFEST).is_file()
    assert not (tmp_path / "ckpt.partial").exists()

    resumed, resumed_opt = build(setup, seed=1)  # other values: all must come from the file
    client_state = load_checkpoint(tmp_path / "ckpt", resumed, resumed_opt)
    assert client_state == {"step": SAVE_AT}
    assert_same_state(state_of(resumed, resumed_opt), state_of(model, opt))
    for index in range(SAVE_AT, STEPS):
        step(resumed, resumed_opt, index)
    assert_same_state(state_of(resumed, resumed_opt), uninterrupted(setup))


@pytest.mark.parametrize("setup", SETUPS)
def test_torch_distributed_checkpoint_api_round_trip(setup, tmp_path):
    """torch's get_state_dict / dcp.save / dcp.load / set_state_dict: the optimizer's
    'lomo' entry (step count, loss scaler, norm history) rides in the param groups, which
    torch keeps; its state tensors are copies, so dcp.load changes nothing until
    set_state_dict has checked them."""
    model, opt = build(setup)
    for index in range(SAVE_AT):
        step(model, opt, index)
    model_state, opt_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": opt_state}, checkpoint_id=tmp_path)
    expected = state_of(model, opt)

    resumed, resumed_opt = build(setup, seed=1)
    live_before = state_of(resumed, resumed_opt)["opt"]
    model_state, opt_state = get_state_dict(resumed, resumed_opt)
    dcp.load({"model": model_state, "optim": opt_state}, checkpoint_id=tmp_path)
    assert_same_state(resumed_opt.state_dict(), live_before)  # loaded into copies only
    set_state_dict(resumed, resumed_opt, model_state_dict=model_state, optim_state_dict=opt_state)
    assert_same_state(state_of(resumed, resumed_opt), expected)
    for index in range(SAVE_AT, STEPS):
        step(resumed, resumed_opt, index)
    assert_same_state(state_of(resumed, resumed_opt), uninterrupted(setup))


def test_lomo_is_never_stepped_with_zero_gradients(tmp_path):
    """torch's state_dict API initialises an optimizer with an empty state by setting a zero
    gradient on every parameter and calling step() (a whole model's gradients at once);
    Lomo's state counts as initialised, before and after a load, so neither happens."""
    model, opt = build("lomo")
    calls = []
    opt.step = lambda closure=None: calls.append(closure)
    zero_like = torch.zeros_like

    def counted(*args, **kwargs):
        calls.append("zeros_like")
        return zero_like(*args, **kwargs)

    torch.zeros_like = counted
    try:
        get_state_dict(model, opt)
        save_checkpoint(tmp_path / "ckpt", model, opt)
        load_checkpoint(tmp_path / "ckpt", model, opt)
        get_state_dict(model, opt)  # the loaded state counts as initialised too
    finally:
        torch.zeros_like = zero_like
    assert calls == []
    assert all(p.grad is None for p in model.parameters())


def scheduled(opt) -> None:
    """A torch lr scheduler on `opt` (it adds 'initial_lr' to each param group)."""
    torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)


# A set-up the saved run and the resumed one differ in, where torch's load_state_dict (and
# ours) takes the state_dict's entries: a scheduler's group entry, the one-backward clip's
# norm history, the fp16 loss scaler's state. Each: the saved run's and the resumed run's
# (setup, options, a function of the optimizer called before the run or None).
SWITCHES = {
    "scheduler_at_save": (("adalomo_groups", {}, scheduled), ("adalomo_groups", {}, None)),
    "scheduler_at_load": (("adalomo_groups", {}, None), ("adalomo_groups", {}, scheduled)),
    "single_backward_at_save": (("lomo", {"single_backward": True}, None), ("lomo", {}, None)),
    "single_backward_at_load": (
        ("adalomo_single", {"single_backward": False}, None),
        ("adalomo_single", {}, None),
    ),
    "fp16_to_fp32": (("lomo_fp16", {}, None), ("lomo", {}, None)),
    "fp32_to_fp16": (("lomo", {}, None), ("lomo_fp16", {}, None)),
}


@pytest.mark.parametrize("switch", SWITCHES)
def test_a_switched_set_up_loads_as_load_state_dict_loads_it(switch, tmp_path):
    """Entries the saved run has and the resumed one lacks, or the other way round, where
    load_state_dict takes the state_dict's: a param group's entries other than the
    optimizer's own (the 'initial_lr' a torch lr scheduler adds), the one-backward clip's norm
    history and the fp16 loss scaler's state. load_checkpoint loads the checkpoint as
    load_state_dict of the saved state_dict does, and the resumed run goes on as that one."""
    (setup, options, call), (resumed_setup, resumed_options, resumed_call) = SWITCHES[switch]
    model, opt = build(setup, **options)
    if call is not None:
        call(opt)
    for index in range(SAVE_AT):
        step(model, opt, index)
    path = save_checkpoint(tmp_path / "ckpt", model, opt)
    resumed, in_memory = (build(resumed_setup, seed=1, **resumed_options) for _ in range(2))
    if resumed_call is not None:
        resumed_call(resumed[1])
        resumed_call(in_memory[1])
    load_checkpoint(path, *resumed)
    in_memory[0].load_state_dict(model.state_dict())
    in_memory[1].load_state_dict(opt.state_dict())
    assert_same_state(state_of(*resumed), state_of(*in_memory))
    if switch.startswith("scheduler"):
        groups = resumed[1].param_groups
        assert all(("initial_lr" in group) == (switch == "scheduler_at_save") for group in groups)
    for index in range(SAVE_AT, STEPS):
        step(*in_memory, index)
        step(*resumed, index)
    assert_same_state(state_of(*resumed), state_of(*in_memory))


@pytest.fixture
def adalomo_checkpoint(tmp_path):
    model, opt = build("adalomo_single")
    for index in range(SAVE_AT):
        step(model, opt, index)
    return save_checkpoint(tmp_path / "ckpt", model, opt)


def refused_unchanged(path, model, opt, error: type[Exception], match: str, **kwargs) -> None:
    load = lambda: load_checkpoint(path, model, opt, **kwargs)  # noqa: E731
    assert_refused(model, opt, load, error, match)


def test_other_model_refused_before_any_change(adalomo_checkpoint):
    model = tiny_llama(vocab_size=97)
    opt = AdaLomo(model, lr=0.01, clip_grad_norm=1.0, single_backward=True)
    refused_unchanged(adalomo_checkpoint, model, opt, CheckpointError, r"shape \(96, .*\(97, ")
    deeper = tiny_llama(num_hidden_layers=3)
    opt = AdaLomo(deeper, lr=0.01, clip_grad_norm=1.0, single_backward=True)
    refused_unchanged(
        adalomo_checkpoint, deeper, opt, CheckpointError, "holds no .model.model.layers.2"
    )


def test_other_optimizer_class_refused_before_any_change(adalomo_checkpoint, tmp_path):
    model, opt = build("lomo")
    refused_unchanged(adalomo_checkpoint, model, opt, CheckpointError, "holds the optimizer entry")
    lomo_checkpoint = save_checkpoint(tmp_path / "lomo", *build("lomo"))
    model, opt = build("adalomo_single")
    refused_unchanged(lomo_checkpoint, model, opt, CheckpointError, "holds no .optimizer.state")


def test_other_hyper_parameter_set_up_refused_before_any_change(adalomo_checkpoint):
    """Param groups split otherwise (the same tensors, their hyper-parameters in two
    groups)."""
    model = tiny_llama()
    embed = model.get_input_embeddings().weight
    rest = [p for p in model.parameters() if p is not embed]
    opt = AdaLomo(
        model,
        lr=0.01,
        clip_grad_norm=1.0,
        single_backward=True,
        param_groups=[{"params": [embed], "lr": 0.001}, {"params": rest}],
    )
    match = "holds no 'optimizer.param_groups.1"
    refused_unchanged(adalomo_checkpoint, model, opt, CheckpointError, match)


def test_corrupt_optimizer_values_refused_before_any_change(tmp_path):
    model, opt = build("adalomo_single")
    step(model, opt, 0)
    next(iter(opt.state.values()))["exp_avg_sq_row"][3] = float("nan")
    path = save_checkpoint(tmp_path / "ckpt", model, opt)
    fresh, fresh_opt = build("adalomo_single", seed=1)
    refused_unchanged(path, fresh, fresh_opt, ValueError, "holds inf/nan")


def test_frozen_parameters_left_out_and_loaded_non_strict(tmp_path):
    model = tiny_llama()
    model.get_input_embeddings().weight.requires_grad_(False)
    opt = Lomo(model, lr=0.05)
    step(model, opt, 0)
    path = save_checkpoint(tmp_path / "ckpt", model, opt, frozen=False)
    fresh = tiny_llama(seed=1)
    fresh.get_input_embeddings().weight.requires_grad_(False)
    fresh_opt = Lomo(fresh, lr=0.05)
    embed = fresh.get_input_embeddings().weight.clone()
    refused_unchanged(path, fresh, fresh_opt, CheckpointError, "holds no .model.model.embed_tokens")
    load_checkpoint(path, fresh, fresh_opt, strict=False)
    assert torch.equal(fresh.get_input_embeddings().weight, embed)  # not in the checkpoint
    for (name, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert p.requires_grad is False or torch.equal(p, q), name


def test_entries_the_run_lacks_refused_strict_and_skipped_non_strict(tmp_path):
    """The reverse of frozen parameters left out: a checkpoint holding a model entry this run
    does not have (a persistent buffer its model lacks) is refused naming it, and loaded
    without it with strict=False, as torch's load_state_dict(strict=False) skips it."""
    model = tiny_llama()
    opt = Lomo(model, lr=0.05)
    step(model, opt, 0)
    model.register_buffer("extra", torch.ones(3))
    path = save_checkpoint(tmp_path / "ckpt", model, opt)
    fresh, fresh_opt = build("lomo", seed=1)
    match = "holds the parameter or buffer 'model.extra', which this run does not have"
    refused_unchanged(path, fresh, fresh_opt, CheckpointError, match)
    load_checkpoint(path, fresh, fresh_opt, strict=False)
    for (name, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_saving_again_replaces_the_checkpoint_only_when_whole(tmp_path):
    model, opt = build("lomo")
    path = save_checkpoint(tmp_path / "ckpt", model, opt, client_state=1)
    stale = tmp_path / "ckpt.partial"
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"left by a save that died")
    step(model, opt, 0)
    save_checkpoint(path, model, opt, client_state=2)
    assert not stale.exists() and not (tmp_path / "ckpt.replaced").exists()
    fresh, fresh_opt = build("lomo", seed=1)
    assert load_checkpoint(path, fresh, fresh_opt) == 2
    assert_same_state(state_of(fresh, fresh_opt), state_of(model, opt))


def test_missing_checkpoint_and_foreign_directory_refused(tmp_path):
    model, opt = build("lomo")
    refused_unchanged(tmp_path / "none", model, opt, CheckpointError, "does not exist")
    refused_unchanged(tmp_path, model, opt, CheckpointError, f"{MANIFEST} is missing")


def test_optimizer_of_another_model_refused(tmp_path):
    model, _ = build("lomo")
    _, other_opt = build("lomo")
    with pytest.raises(ValueError, match="not the model's"):
        save_checkpoint(tmp_path / "ckpt", model, other_opt)


def test_param_groups_lomo_entries_must_agree():
    """After set_state_dict only the param groups carry the 'lomo' entry; copies that differ
    come from different checkpoints."""
    model = tiny_llama()
    embed = model.get_input_embeddings().weight
    rest = [p for p in model.parameters() if p is not embed]
    opt = Lomo(model, lr=0.05, param_groups=[{"params": [embed]}, {"params": rest}])
    state = opt.state_dict()
    del state["lomo"]
    state["param_groups"][1]["lomo"]["step_count"] = 7
    with pytest.raises(ValueError, match="different 'lomo' entries"):
        opt.load_state_dict(state)
    state["param_groups"][1]["lomo"]["step_count"] = 0
    opt.load_state_dict(state)


def test_check_state_dict_refuses_as_load_would_and_changes_nothing():
    model, opt = build("adalomo_single")
    step(model, opt, 0)
    good = opt.state_dict()
    bad = opt.state_dict()
    next(iter(bad["state"].values()))["exp_avg_sq_row"][0] = -1.0
    before = optimizer_snapshot(model, opt)
    opt.check_state_dict(good)
    for check in (opt.check_state_dict, opt.load_state_dict):
        with pytest.raises(ValueError, match="holds negative values"):
            check(bad)
    assert_unchanged_since(before, model, opt)


def test_only_a_tied_name_the_checkpoint_lacks_is_left_out():
    """A load leaves out a name the checkpoint lacks only where the checkpoint holds the same
    tensor under another (a tied weight, saved once by ZeRO-3): another tensor of the same
    size, or meta tensors (which all report memory at 0), must still be found missing."""
    weight = torch.ones(4, 3)
    state = {"embed": weight, "head": weight, "other": torch.ones(4, 3)}
    state.update(a=torch.empty(2, device="meta"), b=torch.empty(2, device="meta"))
    saved = {"model.embed": None, "model.a": None}
    assert set(without_unsaved_aliases(state, saved)) == {"embed", "other", "a", "b"}
