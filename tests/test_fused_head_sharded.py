"""The logits-free loss (patch_causal_lm) under DeepSpeed ZeRO-3 on 2 ranks (torchrun, gloo,
CPU) against one process on the full batch: the partitioned head is gathered for the fused
loss in forward and backward, and training equals one process's within the sharded runs'
update tolerance (sharded_checks.assert_within_update_tolerance)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from sharded_checks import assert_within_update_tolerance, one_process, run_ranks
from sharded_models import STEPS, FusedHeadLlama

deepspeed = pytest.importorskip("deepspeed")

WORKER = Path(__file__).parent / "distributed" / "fused_head_worker.py"


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory) -> Path:
    return run_ranks(WORKER, tmp_path_factory.mktemp("fused_head_zero3"), "fused-head ZeRO-3")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lomo", "adalomo"])
def test_fused_head_under_zero3_equals_one_process(zero3_run, name):
    saved = torch.load(zero3_run / f"{name}.pt")
    assert saved["head_partitioned"], "the head must be partitioned for this test to mean much"
    model, _ = one_process(name, saved["initial"], STEPS, model_class=FusedHeadLlama)
    assert_within_update_tolerance(saved["final"], model.state_dict(), saved["initial"])
