"""Gradient accumulation under ZeRO-3 and FSDP2 on 2 ranks (torchrun, gloo, CPU) against one
process with the same accumulation on the full micro-batches: each rank accumulates its
reduced slices (a buffer of 1/W of each parameter), measures its part of the accumulated
norm, and every rank applies the same step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.dependencies import require
from support.sharded_checks import (
    assert_within_update_tolerance,
    one_process,
    rank_run_fixtures,
)
from support.sharded_models import ACCUMULATING, STEPS, train_accumulating

deepspeed = require("deepspeed")

WORKER = Path(__file__).parent / "accumulation_worker.py"

accumulation_run, checks = rank_run_fixtures(WORKER, "sharded accumulation", "accumulation_run")


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["zero3", "fsdp2"])
@pytest.mark.parametrize("name", ["lomo", "adalomo"])
def test_sharded_accumulation_equals_one_process(accumulation_run, checks, engine, name):
    saved = torch.load(accumulation_run / f"{engine}_{name}.pt")
    model, opt = one_process(
        name, saved["initial"], steps=STEPS, train_fn=train_accumulating, options=ACCUMULATING
    )
    assert opt.step_count == STEPS
    assert_within_update_tolerance(saved["final"], model.state_dict(), saved["initial"])
    norms = [rank[f"{engine}_{name}"]["norm"] for rank in checks]
    assert norms[0] == norms[1]  # one all-reduced norm: the same step on every rank
    # The accumulated gradient's norm: the same rounding effects as the parameters'.
    assert norms[0] == pytest.approx(float(opt.last_grad_norm), rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["zero3", "fsdp2"])
def test_sharded_checkpoint_mid_accumulation_is_refused_on_every_rank(checks, engine):
    for rank in checks:
        seen = rank[f"{engine}_lomo"]
        assert seen["step_count"] == STEPS
        assert "1 of 4 micro-batches accumulated" in seen["refused_mid_step"]
        assert seen["pending_after_zero_grad"] == 0
