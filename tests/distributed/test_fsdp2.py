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

from pathlib import Path

import pytest
import torch
from support.models import LayerInTwoCheckpoints
from support.sharded_checks import (
    OPTIMIZERS,
    assert_checkpoint_resumes,
    assert_grad_norms_match,
    assert_no_worse_than_low_precision,
    assert_ranks_agree,
    assert_setups_refused,
    assert_single_backward_run,
    assert_unfrozen_refused,
    assert_within_update_tolerance,
    one_process,
    one_process_single,
    rank_run_fixtures,
)
from support.sharded_models import (
    GRADIENT_IN_PARTS,
    NO_CLIP,
    PATTERNS,
    WORLD,
    parts_batch,
)
from support.sliced_rounding import assert_slices_as_whole

pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 needs torch >= 2.6")

WORKER = Path(__file__).parent / "fsdp2_worker.py"
FP16_LABELS = ["lomo_fp16_params", "lomo_fp16_compute", "adalomo_fp16_params"]
# The worker's refused setups (besides replicated=True) and a phrase of each one's message.
REFUSALS = {
    "root_not_sharded": "Apply fully_shard to the root module",
    "shard_dim_1": "only Shard(0) is supported",
    "hsdp": "only a 1-D FSDP2 mesh is supported",
    "partial_world": "sharded over 1 of 2 ranks",
}


fsdp2_run, checks = rank_run_fixtures(WORKER, "FSDP2", "fsdp2_run")


@pytest.mark.slow
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fsdp2_training_equals_one_process(fsdp2_run, name, pattern):
    saved = torch.load(fsdp2_run / f"{name}_{pattern}.pt")
    model, opt = one_process(name, saved["initial"], steps=3, train_fn=PATTERNS[pattern])
    assert_within_update_tolerance(saved["final"], model.state_dict(), saved["initial"])
    # Each whole parameter's gradient norm of the last norm pass, on every rank: one entry
    # per parameter as in one process (the ranks' sums of squares of their rows, reduced).
    assert_grad_norms_match(saved["grad_norms"], opt.grad_norms)


@pytest.mark.slow
@pytest.mark.parametrize("label", GRADIENT_IN_PARTS)
def test_fsdp2_gradient_in_parts_equals_one_process_with_it_whole(fsdp2_run, label):
    """A layer in two reentrant checkpoint segments (its gradient in two parts, refused in
    one process and under ZeRO-3): FSDP2 sums the parts before its reduce, so two steps
    equal one process's with non-reentrant segments on both ranks' rows (clip and weight
    decay with Lomo, weight decay with AdaLomo)."""
    saved = torch.load(fsdp2_run / f"parts_{label}.pt")
    name, options = GRADIENT_IN_PARTS[label]
    model = LayerInTwoCheckpoints(reentrant=False)
    model.load_state_dict(saved["initial"])
    opt = OPTIMIZERS[name](model, lr=0.05, **options)
    x = torch.cat([parts_batch(rank) for rank in range(WORLD)])
    for _ in range(2):
        if opt.clip_grad_norm is not None:
            opt.grad_norm(model(x))
        opt.fused_backward(model(x))
    assert_within_update_tolerance(saved["final"], model.state_dict(), saved["initial"])


@pytest.mark.slow
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fsdp2_single_backward_equals_one_process(fsdp2_run, checks, name):
    """single_backward=True (clip, weight decay): one backward per step, the same norms on
    every rank, the parameters and norms of one process taking the gradients in FSDP2's
    order (unit by unit, the root last)."""
    assert_single_backward_run(fsdp2_run, checks, name)


@pytest.mark.slow
def test_fsdp2_single_backward_fp16_equals_one_process(fsdp2_run, checks):
    """single_backward=True, Lomo, fp16 shards and compute with loss scaling, 3 clean steps:
    no worse against fp32 than one process in fp16 taking the gradients in FSDP2's order."""
    results = [rank["single_fp16_lomo"] for rank in checks]
    assert_ranks_agree(results)
    for rank in results:
        assert rank["partial"] == [False] * 3  # clean steps: the scale stays where it was
        assert rank["scales"] == [results[0]["scales"][0]] * 4
    saved = torch.load(fsdp2_run / "single_fp16_lomo.pt")
    order, lr = results[0]["order"], saved["lr"]
    low, low_norms = one_process_single("lomo", saved["initial"], order, dtype=torch.float16, lr=lr)
    ref, ref_norms = one_process_single("lomo", saved["initial"], order, lr=lr)
    assert_no_worse_than_low_precision(
        saved["final"], low.state_dict(), ref.state_dict(), saved["initial"]
    )
    for got, lowp, expected in zip(results[0]["norms"], low_norms, ref_norms, strict=True):
        assert abs(got - expected) <= 2 * abs(lowp - expected) + 1e-6 * expected


@pytest.mark.slow
@pytest.mark.parametrize("label", FP16_LABELS)
def test_fsdp2_single_backward_fp16_inf_on_one_rank_is_partial(checks, label):
    """single_backward=True in fp16: rank 1 alone puts an inf into its rows of lm_head's
    gradient. On every rank that tensor alone (both ranks' rows, and its moments) is left
    unchanged, nothing becomes non-finite, the loss scale halves, the step is reported
    partial; the next two steps update every tensor."""
    results = [rank[f"single_partial_{label}"] for rank in checks]
    first = results[0]
    for result in results:
        assert result["phases"] == ["update"]
        assert result["finite"] and all(later["finite"] for later in result["later"])
        assert result["unchanged"] == [result["target"]] and len(result["held"]) > 5
        assert result["moments_unchanged"]
        if result["scale_before"] is not None:  # Lomo's dynamic scale; AdaLomo's is static
            assert result["scale_after"] == result["scale_before"] / 2
        assert result["partial"] and not result["skipped"] and result["warned"]
        assert result["norm"] == first["norm"] and result["norm"] > 0
        # The partial step is not a clean one: it leaves no norm in the history.
        assert result["norm_history"] == [0.0, 0.0, 0.0]
        assert result["norm_history_after"] == first["norm_history_after"]
        assert min(result["norm_history_after"]) > 0
        for later in result["later"]:
            assert not later["partial"] and later["unchanged"] == []


@pytest.mark.slow
def test_fsdp2_inf_on_one_rank_without_a_norm_pass_is_partial_on_every_rank(checks):
    """Lomo in fp32 without clipping runs no norm pass: rank 1 alone puts an inf into one
    element of its rows of lm_head's gradient. That element alone is left unchanged (the
    step is elementwise, as in one process), and every rank, not only rank 1, reports the
    step partial: the ranks' overflow flags are all-reduced after the update pass."""
    results = [rank["partial_without_norm_pass"] for rank in checks]
    for rank, result in enumerate(results):
        assert result["phases"] == ["update"] and result["finite"]
        assert result["unchanged"] == [], result["unchanged"]
        assert result["partial"] and not result["skipped"] and result["warned"], rank
    assert results[1]["element_unchanged"] and not results[0]["element_unchanged"]


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
@pytest.mark.parametrize("label", ["bf16_compute", "bf16_params", "bf16_params_stochastic"])
def test_fsdp2_mixed_precision_matches_plain_update(fsdp2_run, label):
    """MixedPrecisionPolicy: bf16 compute on fp32 shards, and bf16 throughout.

    Reference: the same FSDP2 set-up with a plain backward and the clipped, decayed SGD step
    written in torch ops on the local shards (fp32 math, one rounding to the shard dtype: to
    nearest, or stochastically with the bits of each element's index in the whole parameter,
    so each rank's rows round as one process's whole tensor would).
    """
    saved = torch.load(fsdp2_run / f"mixed_{label}.pt")
    dtype = torch.float32 if label == "bf16_compute" else torch.bfloat16
    assert all(v.dtype == dtype for v in saved["lomo"].values())  # shards keep their dtype
    assert_within_update_tolerance(saved["lomo"], saved["manual"], saved["initial"])
    if label == "bf16_params_stochastic":
        # The same draws per element: the bits agree except where the two fp32 results
        # differ (gradients reduced in another order) and a draw falls between them.
        nearest = torch.load(fsdp2_run / "mixed_bf16_params.pt")["manual"]
        for name, ours in saved["lomo"].items():
            same = (ours == saved["manual"][name]).double().mean().item()
            as_nearest = (ours == nearest[name]).double().mean().item()
            assert same >= 0.99 and same > as_nearest, (name, same, as_nearest)


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["stochastic_slices", "stochastic_accumulation"])
def test_fsdp2_stochastic_slices_round_as_the_whole_parameter(checks, scenario):
    """bf16 shards with stochastic rounding, an update (weight decay on) and an accumulation
    (two micro-batches into bf16 buffers): the ranks' rows, gathered, hold bit for bit what
    the reference op stores for each whole parameter from the same reduced gradients; rows
    that do not start at a multiple of 32, stepped as if each began its parameter, store
    other bits."""
    for rank in checks:
        assert_slices_as_whole(rank[scenario])


@pytest.mark.slow
@pytest.mark.parametrize("label", FP16_LABELS)
def test_fsdp2_fp16_overflow_on_one_rank_changes_nothing(checks, label):
    """An inf in a gradient row that only rank 1 holds: every rank skips, nothing changes."""
    for rank in checks:
        result = rank[label]
        assert result["loss_scaling"]  # fp16 compute (param_dtype) switches the check pass on
        assert result["unchanged"] and result["skipped"]
        # AdaLomo's moments kept their bits; Lomo keeps no per-parameter state.
        assert (result["moments"] > 0) == label.startswith("adalomo")
        assert result["moments_unchanged"]
        if result["scale_before"] is not None:
            assert result["scale_after"] == result["scale_before"] / 2
        assert result["next_step_updates"]


@pytest.mark.slow
def test_fsdp2_unsupported_setups_refused_at_construction(checks):
    assert_setups_refused(checks, REFUSALS)


@pytest.mark.slow
def test_fsdp2_gradient_accumulation_refused(checks):
    for rank in checks:
        assert "cannot accumulate gradients" in rank["no_sync"]
        assert rank["no_sync_changed"] is None, rank["no_sync_changed"]


@pytest.mark.slow
def test_fsdp2_parameter_unfrozen_after_construction_refused_before_any_change(checks):
    """As in one process: a parameter frozen when the optimizer was built has no hook, so it
    would get no step (and keep its gradient). Sharded, the check compares the trainable
    parameters' names (FSDP2 swaps the registered tensors themselves)."""
    assert_unfrozen_refused(checks)
