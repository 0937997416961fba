"""The logits-free loss (patch_causal_lm) under DeepSpeed ZeRO-3 and FSDP2 on 2 ranks
(torchrun, gloo, CPU) against one process on the full batch: the sharded head is gathered
for the fused loss in forward and backward, and training equals one process's within the
sharded runs' update tolerance (support.sharded_checks.assert_within_update_tolerance)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.dependencies import require
from support.sharded_checks import assert_within_update_tolerance, one_process, run_ranks
from support.sharded_models import STEPS, FusedHeadLlama

deepspeed = require("deepspeed")

WORKER = Path(__file__).parent / "fused_head_worker.py"


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory) -> Path:
    return run_ranks(WORKER, tmp_path_factory.mktemp("fused_head"), "fused-head ZeRO-3/FSDP2")


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["zero3", "fsdp2"])
@pytest.mark.parametrize("name", ["lomo", "adalomo"])
def test_fused_head_sharded_equals_one_process(sharded_run, engine, name):
    saved = torch.load(sharded_run / f"{engine}_{name}.pt")
    assert saved["head_partitioned"], "the head must be partitioned for this test to mean much"
    model, _ = one_process(name, saved["initial"], STEPS, model_class=FusedHeadLlama)
    assert_within_update_tolerance(saved["final"], model.state_dict(), saved["initial"])
