"""DynamicLossScaler against lomo_optim's, step by step over sequences of overflows.

The scaler keeps its state in device tensors; lomo_optim's keeps Python numbers. Every
setting it takes (window, factor, minimum, delayed shift, consecutive hysteresis) must move
the scale, the hysteresis and the counters exactly as lomo_optim's does.
"""

from __future__ import annotations

import random

import pytest
import torch
from support.dependencies import require

from lomo_kernels.optim.loss_scaler import DynamicLossScaler

lomo_optim = require("lomo_optim")

SETTINGS = {
    "default": {},
    "window3": {"scale_window": 3},
    "factor4": {"scale_factor": 4.0, "scale_window": 2},
    "delayed3": {"delayed_shift": 3, "scale_window": 4},
    "delayed3_consecutive": {"delayed_shift": 3, "consecutive_hysteresis": True, "scale_window": 4},
    "min_no_raise": {"min_scale": 2.0**36, "raise_error_at_min_scale": False, "scale_window": 2},
}


def overflows(seed: int, steps: int = 60) -> list[bool]:
    """Clean runs of 1-6 steps between overflow runs of 1-3 (hysteresis and the window)."""
    rng = random.Random(seed)
    out: list[bool] = []
    while len(out) < steps:
        out += [False] * rng.randint(1, 6) + [True] * rng.randint(1, 3)
    return out[:steps]


@pytest.mark.parametrize("settings", SETTINGS.values(), ids=SETTINGS.keys())
def test_scale_and_hysteresis_follow_lomo_optim(monkeypatch, capsys, settings):
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a: 0)  # lomo_optim prints
    args = {"init_scale": 2.0**40, **settings}
    ours = DynamicLossScaler(torch.device("cpu"), **args)
    theirs = lomo_optim.lomo.DynamicLossScaler(**args)
    scales = set()
    for step, overflow in enumerate(overflows(seed=7)):
        ours.update(torch.tensor([float(overflow)]))
        theirs.update_scale(overflow)
        got = (ours.loss_scale, int(ours.hysteresis), int(ours.cur_iter))
        want = (theirs.cur_scale, theirs.cur_hysteresis, theirs.cur_iter)
        assert got == want, (step, overflow, got, want)
        assert int(ours.last_overflow_iter) == theirs.last_overflow_iter
        assert ours.inv_scale.item() == 1.0 / theirs.cur_scale  # a power of two: exact
        assert ours.has_overflow_serial == overflow
        scales.add(theirs.cur_scale)
    assert len(scales) >= 3  # the sequence moved the scale more than once
    capsys.readouterr()


def test_overflow_at_the_minimum_is_flagged_as_lomo_optim_raises(monkeypatch, capsys):
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a: 0)
    args = {"init_scale": 4.0, "min_scale": 2.0}
    ours = DynamicLossScaler(torch.device("cpu"), **args)
    theirs = lomo_optim.lomo.DynamicLossScaler(**args)
    for scaler_update in (lambda o: ours.update(torch.tensor([float(o)])), theirs.update_scale):
        scaler_update(True)  # 4 -> 2, the minimum
    assert ours.loss_scale == theirs.cur_scale == 2.0 and ours.overflow_at_min.item() == 0
    with pytest.raises(Exception, match="already at minimum"):  # lomo_optim raises a bare one
        theirs.update_scale(True)
    ours.update(torch.tensor([1.0]))
    assert ours.overflow_at_min.item() == 1 and ours.loss_scale == 2.0
    capsys.readouterr()


def test_a_loaded_state_holds_no_outcome_of_the_steps_before_it():
    """A checkpoint holds the scale and the counters, not the last step's outcome: after
    `load_state_dict` the scaler is as a fresh one that loaded the same state (no overflow
    reported, none at the minimum, the inverse scale the loaded scale's), whatever steps the
    loading scaler took before."""
    saved = DynamicLossScaler(torch.device("cpu"), init_scale=2.0**10).state_dict()
    loading = DynamicLossScaler(torch.device("cpu"), init_scale=4.0, min_scale=4.0)
    loading.update(torch.tensor([1.0]))  # an overflow at the minimum scale
    assert loading.has_overflow_serial and loading.overflow_at_min.item() == 1
    fresh = DynamicLossScaler(torch.device("cpu"))
    for scaler in (loading, fresh):
        scaler.load_state_dict(saved)
    assert loading.state_dict() == fresh.state_dict() == saved
    for scaler in (loading, fresh):
        assert not scaler.has_overflow_serial and scaler.overflow_at_min.item() == 0
        assert scaler.inv_scale.item() == 2.0**-10 and scaler.times_set == 1
