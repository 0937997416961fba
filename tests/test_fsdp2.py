"""FSDP2 on 2 ranks (torchrun, gloo, CPU) against one process on the full batch.

The ranks run tests/distributed/fsdp2_worker.py once for the whole module: a transformers
LLaMA with fully_shard on each decoder layer and on the root (uneven rows: 3001-row
embedding and head, 73-row MLP, a 1-element parameter one rank holds nothing of). The
consolidated initial and final parameters of each run are compared here with the same
training in this process, for both calling patterns, with clipping and weight decay on.
Comparing numbers (not just running) also guards against a reduce-scatter that sums
instead of averaging.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from sharded_checks import (
    OPTIMIZERS,
    assert_checkpoint_resumes,
    assert_single_backward_matches,
    assert_within_update_tolerance,
    one_process,
    run_ranks,
)
from sharded_models import NO_CLIP, PATTERNS

pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 needs torch >= 2.6")

WORKER = Path(__file__).parent / "distributed" / "fsdp2_worker.py"


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory) -> Path:
    return run_ranks(WORKER, tmp_path_factory.mktemp("fsdp2"), "FSDP2")


@pytest.fixture(scope="module")
def checks(fsdp2_run) -> list[dict]:
    return json.loads((fsdp2_run / "checks.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fsdp2_training_equals_one_process(fsdp2_run, name, pattern):
    saved = torch.load(fsdp2_run / f"{name}_{pattern}.pt")
    model, _ = one_process(name, saved["initial"], steps=3, train_fn=PATTERNS[pattern])
    assert_within_update_tolerance(saved["final"], model.state_dict(), saved["initial"])


@pytest.mark.slow
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fsdp2_single_backward_equals_one_process(fsdp2_run, checks, name):
    """single_backward=True (clip, weight decay): one backward per step, the same norms on
    every rank, the parameters and norms of one process taking the gradients in FSDP2's
    order (unit by unit, the root last)."""
    saved = torch.load(fsdp2_run / f"single_{name}.pt")
    assert_single_backward_matches(saved, [rank[f"single_{name}"] for rank in checks], name)


@pytest.mark.slow
def test_fsdp2_gradients_averaged_not_summed(fsdp2_run):
    """Without clipping the update is proportional to the gradient: a reduce-scatter that
    summed over the ranks (gloo's old AVG pitfall) would double it and fail here."""
    saved = torch.load(fsdp2_run / "lomo_per_pass_no_clip.pt")
    model, _ = one_process("lomo", saved["initial"], steps=3, options=NO_CLIP)
    assert_within_update_tolerance(saved["final"], model.state_dict(), saved["initial"])


@pytest.mark.slow
def test_fsdp2_units_kept_unsharded_see_the_update(fsdp2_run):
    """reshard_after_backward=False: the next forward must not use the pre-update gather."""
    saved = torch.load(fsdp2_run / "lomo_per_pass_unsharded.pt")
    model, _ = one_process("lomo", saved["initial"], steps=3)
    assert_within_update_tolerance(saved["final"], model.state_dict(), saved["initial"])


@pytest.mark.slow
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fsdp2_checkpoint_resumes_in_one_process(fsdp2_run, name):
    assert_checkpoint_resumes(torch.load(fsdp2_run / f"{name}_per_pass.pt"), name)


@pytest.mark.slow
@pytest.mark.parametrize("label", ["bf16_compute", "bf16_params"])
def test_fsdp2_mixed_precision_matches_plain_update(fsdp2_run, label):
    """MixedPrecisionPolicy: bf16 compute on fp32 shards, and bf16 throughout.

    Reference: the same FSDP2 set-up with a plain backward and the clipped, decayed SGD step
    written in torch ops on the local shards (fp32 math, one rounding to the shard dtype).
    """
    saved = torch.load(fsdp2_run / f"mixed_{label}.pt")
    dtype = torch.float32 if label == "bf16_compute" else torch.bfloat16
    assert all(v.dtype == dtype for v in saved["lomo"].values())  # shards keep their dtype
    assert_within_update_tolerance(saved["lomo"], saved["manual"], saved["initial"])


@pytest.mark.slow
@pytest.mark.parametrize("label", ["lomo_fp16_params", "lomo_fp16_compute", "adalomo_fp16_params"])
def test_fsdp2_fp16_overflow_on_one_rank_changes_nothing(checks, label):
    """An inf in a gradient row that only rank 1 holds: every rank skips, nothing changes."""
    for rank in checks:
        result = rank[label]
        assert result["loss_scaling"]  # fp16 compute (param_dtype) switches the check pass on
        assert result["unchanged"] and result["skipped"] and result["states_zero"]
        if result["scale_before"] is not None:
            assert result["scale_after"] == result["scale_before"] / 2
        assert result["next_step_updates"]


@pytest.mark.slow
def test_fsdp2_unsupported_setups_refused_at_construction(checks):
    for rank in checks:
        refused = rank["refusals"]
        assert "each rank would apply its own unreduced gradient" in refused["replicated"]
        assert "Apply fully_shard to the root module" in refused["root_not_sharded"]
        assert "only Shard(0) is supported" in refused["shard_dim_1"]
        assert "only a 1-D FSDP2 mesh is supported" in refused["hsdp"]


@pytest.mark.slow
def test_fsdp2_gradient_accumulation_refused(checks):
    for rank in checks:
        assert "cannot accumulate gradients" in rank["no_sync"]
        assert rank["no_sync_unchanged"]
