"""ZeRO-3 on 2 ranks (torchrun, gloo, CPU) against one process on the full batch.

The ranks run tests/distributed/zero3_worker.py once for the whole module; it saves the
consolidated initial and final parameters of each run, which are compared here with the
same training in this (single) process started from the same values (zero.Init initialises
differently from a plain construction).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from support.dependencies import require
from support.sharded_checks import (
    OPTIMIZERS,
    assert_checkpoint_resumes,
    assert_grad_norms_match,
    assert_setups_refused,
    assert_single_backward_run,
    assert_unfrozen_refused,
    assert_within_update_tolerance,
    one_process,
    rank_run_fixtures,
)
from support.sliced_rounding import assert_slices_as_whole

deepspeed = require("deepspeed")

WORKER = Path(__file__).parent / "zero3_worker.py"


zero3_run, checks = rank_run_fixtures(WORKER, "ZeRO-3", "zero3_run")

# The worker's refused setups and a phrase of each one's message (replicated=True: besides
# the unreduced gradients every wrapper names, the way out).
REFUSALS = {
    "engine_with_optimizer": "without optimizer=",
    "module_with_optimizer": "ZeRO-3 optimizer",
    "replicated": "pass replicated=False",
}


@pytest.mark.slow
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_zero3_training_equals_one_process(zero3_run, name):
    saved = torch.load(zero3_run / f"{name}.pt")
    model, opt = one_process(name, saved["initial"], steps=3)
    assert_within_update_tolerance(saved["final"], model.state_dict(), saved["initial"])
    # Each whole parameter's gradient norm of the last norm pass (partitions' sums, reduced).
    assert_grad_norms_match(saved["grad_norms"], opt.grad_norms)


@pytest.mark.slow
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_zero3_checkpoint_resumes_in_one_process(zero3_run, name):
    """The consolidated model and optimizer state continue in one process as if unsharded."""
    assert_checkpoint_resumes(torch.load(zero3_run / f"{name}.pt"), name)


@pytest.mark.slow
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_zero3_single_backward_equals_one_process(zero3_run, checks, name):
    """single_backward=True (clip, weight decay): one forward and backward per step, the
    same norms on every rank, the parameters and norms of one process taking the gradients
    in the same order."""
    assert_single_backward_run(zero3_run, checks, name)


@pytest.mark.slow
def test_zero3_single_backward_fp16_inf_on_one_rank_is_partial(checks):
    """Rank 1 alone puts an inf into a gradient element rank 0 owns: on every rank that
    tensor (and only it) is left unchanged, the scale halves, the step is reported partial."""
    first = checks[0]["single_fp16_partial"]
    for rank in checks:
        result = rank["single_fp16_partial"]
        assert result["phases"] == ["update"]
        assert result["unchanged"] == [result["target"]] and result["owned"] > 5
        assert result["scale_after"] == result["scale_before"] / 2
        assert result["partial"] and not result["skipped"] and result["warned"]
        assert result["norm"] == first["norm"] and result["norm"] > 0
        assert result["norm_history"] == first["norm_history"] == [0.0, 0.0, 0.0]


@pytest.mark.slow
def test_zero3_persistent_parameters_refreshed(checks):
    for rank in checks:
        for name in OPTIMIZERS:
            assert rank[name]["persistent"] > 0  # compared: the check below is not vacuous
            assert rank[name]["stale_persistent"] == []


# The refusals of the one-loss pattern (sharded_steps.py), in the worker's order: an update
# pass without its norm pass; after grad_norm, its loss again, a norm pass at another clip
# threshold, and its loss again after clipping was turned off.
ONE_LOSS_REFUSALS = (
    "this step needs a norm pass (clip_grad_norm or fp16) before the update",
    "fused_backward got the loss grad_norm already back-propagated",
    "this step needs a norm pass (clip_grad_norm or fp16) before the update",
    "fused_backward got the loss grad_norm already back-propagated",
)


def assert_nan_padding_planted(results: list[dict]) -> None:
    """The worker wrote a NaN into the padding of the partitions before comparing: some
    rank has padding (the 1-element `temperature` leaves rank 1 one word), and there the
    whole-partition torch.equal says changed: the owned-element check is what said
    unchanged."""
    padded = [r for r in results if r["padding"]]
    assert padded
    assert not any(r["whole_equal"] for r in padded)


@pytest.mark.slow
def test_zero3_one_loss_pattern_refused_before_any_change(checks):
    results = [rank["one_loss"] for rank in checks]
    for result in results:
        errors = result["errors"]
        assert len(errors) == len(ONE_LOSS_REFUSALS)
        for error, refusal in zip(errors, ONE_LOSS_REFUSALS, strict=True):
            assert error.startswith(refusal) and "grad_norm(model(x))" in error, error
        assert result["changed"] is None, result["changed"]
        assert result["pattern_steps"]  # the refusals left grad_norm's measurement
    assert_nan_padding_planted(results)


@pytest.mark.slow
def test_zero3_gradient_in_parts_refused_as_in_one_process(checks):
    """A layer in two reentrant checkpoint segments: every rank refuses its second part,
    naming use_reentrant=False, as one process does (ZeRO-3 reduces each part on its own,
    so stepping them would decay, clip and normalise the layer twice). With a norm pass
    nothing changed; without one, nothing changed that the report leaves out."""
    for rank in checks:
        results = rank["gradient_in_parts"]
        for label, result in results.items():
            error = result["error"]
            assert error is not None, label
            assert re.search(r"'layer\.(weight|bias)' got a second gradient", error), error
            assert "use_reentrant=False" in error, error
            assert set(result["changed_names"]) <= set(result["reported_names"]), result
        assert results["lomo_clip"]["changed"] is None, results["lomo_clip"]["changed"]


@pytest.mark.slow
def test_zero3_fp16_overflow_on_one_rank_changes_nothing(checks):
    results = [rank["fp16_overflow"] for rank in checks]
    for result in results:
        assert result["unchanged"] and result["skipped"]
        assert result["scale_after"] == result["scale_before"] / 2
        assert result["next_step_updates"]
    assert_nan_padding_planted(results)


@pytest.mark.slow
def test_zero3_gradient_traffic_and_bucket_count(checks):
    for rank in checks:
        t = rank["traffic"]
        world, size = t["world"], t["element_size"]
        factor = (world - 1) / world  # ring cost per byte handed to a reduce-scatter
        scatters = [b for kind, b in t["calls"] if kind == "reduce_scatter"]
        ours = factor * sum(scatters)
        all_reduce_scheme = 2 * factor * size * sum(t["numels"])  # one all-reduce per param
        assert ours <= 0.55 * all_reduce_scheme, (ours, all_reduce_scheme)
        # Greedy packing: any two consecutive buckets together exceed one bucket, so the
        # number of buckets is at most 2 * total / bucket + 1 (+1 per oversized gradient).
        total = sum(t["padded"])
        oversized = sum(p >= t["bucket_numel"] for p in t["padded"])
        assert len(scatters) <= 2 * total / t["bucket_numel"] + 1 + oversized
        # Each bucket hands over at most bucket_numel elements (every rank's part of it), but
        # a gradient alone larger, which gets a bucket of its own.
        cap = t["bucket_numel"] * size
        assert sum(b > cap for b in scatters) <= oversized
        assert max(scatters) <= max(cap, size * max(t["padded"]))
        assert len(scatters) < len(t["numels"])  # bucketing did merge small gradients
        assert not any(kind == "all_reduce" and b > 64 for kind, b in t["calls"])


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["stochastic_slices", "stochastic_accumulation"])
def test_zero3_stochastic_slices_round_as_the_whole_parameter(checks, scenario):
    """bf16 partitions with stochastic rounding, an update and an accumulation (two
    micro-batches into bf16 buffers): the ranks' slices, gathered, hold bit for bit what the
    reference op stores for each whole parameter from the same reduced gradients; slices
    that do not start at a multiple of 32, stepped as if each began its parameter, store
    other bits (some: a small slice may draw the same by chance)."""
    for rank in checks:
        assert_slices_as_whole(rank[scenario])


def test_zero3_unsupported_setups_refused(checks):
    assert_setups_refused(checks, REFUSALS)


@pytest.mark.slow
def test_zero3_unreplicated_opt_in_trains_each_rank_alone(checks):
    """Lomo(..., replicated=False) on 2 ranks: each rank's step equals torch.optim.SGD on its
    own batch in its own process (within 1e-6 relative, the bound of the one-process SGD
    parity tests), and the ranks' models differ: no gradient was reduced across ranks."""
    runs = [rank["unreplicated"] for rank in checks]
    for run in runs:
        assert run["rel_diff_to_sgd"] <= 1e-6, run
    assert runs[0]["checksum"] != runs[1]["checksum"]


@pytest.mark.slow
def test_zero3_parameter_unfrozen_after_construction_refused_before_any_change(checks):
    """As in one process: a parameter frozen when the optimizer was built has no hook, so it
    would get no step (and keep its gradient). Sharded, the check compares the trainable
    parameters' names (FSDP2 swaps the registered tensors themselves)."""
    assert_unfrozen_refused(checks)
