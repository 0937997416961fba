"""Gradient accumulation under ZeRO-3 and FSDP2 on 2 ranks (torchrun, gloo, CPU) against one
process with the same accumulation on the full micro-batches (full steps, then a short one
applied by opt.step()): each rank accumulates its reduced slices (a buffer of 1/W of each
parameter), measures its part of the accumulated norm, and every rank applies the same
step. An inf in one micro-batch on one rank only skips the step on every rank; a micro-batch
FSDP2 refuses (gradient sync off) between pending ones leaves no trace."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import pytest
import torch
from support.dependencies import require
from support.sharded_checks import (
    assert_within_update_tolerance,
    one_process,
    rank_run_fixtures,
)
from support.sharded_models import (
    ACCUMULATING,
    ACCUMULATING_INT8,
    LR,
    OVERFLOW_RUNS,
    POISONED_MICRO_BATCH,
    STEPS,
    ScaledLlama,
    train_accumulating,
)
from support.state import same_bits, snapshot

from lomo_kernels.core.int8_blocks import INT8_BLOCK

deepspeed = require("deepspeed")

WORKER = Path(__file__).parent / "accumulation_worker.py"

accumulation_run, checks = rank_run_fixtures(WORKER, "sharded accumulation", "accumulation_run")


def one_process_seen(name: str, saved: dict, options: dict):
    """The run in one process from the saved initial values: (model, opt, what it saw: each
    step's norm and clip coefficient; with the 8-bit buffer, each step's buffer values and,
    after every micro-batch, each buffer's block scales with the step they belong to)."""
    seen: dict = {"norms": [], "coefs": [], "values": [], "scales": []}
    int8 = options.get("accumulation_dtype") == torch.int8

    def train(model, opt, batch_of, steps):
        names = {id(p): n for n, p in model.named_parameters()}

        def note(micro_batch: bool, step: int) -> None:
            buffers = {names[id(p)]: b for p, b, _ in opt._accumulation._buffers.values()}
            if int8 and micro_batch:  # the scales this micro-batch's roundings took
                seen["scales"].append((step, {n: b.scales.double() for n, b in buffers.items()}))
            if opt.step_count > step:  # applied: the buffers still hold the step's sums
                seen["norms"].append(float(opt.last_grad_norm))
                seen["coefs"].append(float(opt.clip_coef))
                if int8:
                    seen["values"].append({n: values(b) for n, b in buffers.items()})

        train_accumulating(model, opt, batch_of, steps, after_call=note)

    model, opt = one_process(name, saved["initial"], STEPS, train_fn=train, options=options)
    return model, opt, seen


def values(buffer) -> torch.Tensor:
    """A whole parameter's 8-bit buffer's values, flat: each code times its block's scale."""
    blocks = torch.arange(buffer.codes.numel()) // INT8_BLOCK
    return buffer.codes.reshape(-1).double() * buffer.scales.double()[blocks]


def assert_buffers_are_the_slices(checks: list[dict], key: str, model, int8: bool) -> None:
    """Each rank's buffers hold exactly its slices, as the engine cut the parameters."""
    params = dict(model.named_parameters())
    shards = [rank[key]["shards"] for rank in checks]
    for name, param in params.items():
        # The engine's slices: consecutive, together each element of the parameter once.
        parts = sorted(tuple(shard[name]) for shard in shards)
        assert parts[0][0] == 0 and sum(n for _, n in parts) == param.numel(), (name, parts)
        assert all(a + n == b for (a, n), (b, _) in pairwise(parts)), (name, parts)
    for rank, shard in zip(checks, shards, strict=True):
        # The optimizer's buffers: one per parameter the rank holds elements of, at its
        # slice's offset, with its slice's elements (a rank holding none may keep an empty one).
        buffers = {n: part for n, part in rank[key]["buffers"].items() if part[1]}
        assert buffers == {n: part for n, part in shard.items() if part[1]}

    def nbytes(name: str, offset: int, n: int) -> int:
        if not int8:
            return n * params[name].element_size()
        # A code per element, an fp32 scale per block of the parameter the slice touches.
        return n + 4 * ((offset + n - 1) // INT8_BLOCK - offset // INT8_BLOCK + 1 if n else 0)

    held = [rank[key]["buffer_bytes"] for rank in checks]
    assert held == [sum(nbytes(n, *part) for n, part in shard.items()) for shard in shards]
    # About 1/W of the model each: a slice is at most one row (FSDP2's dim-0 chunks) or one
    # element (ZeRO-3) over 1/W of its parameter (8-bit: and two scales, its edge blocks).
    whole = sum(nbytes(n, 0, p.numel()) for n, p in params.items())
    rows = sum(nbytes(n, 0, p.numel() // p.shape[0]) + 8 * int8 for n, p in params.items())
    assert max(held) <= whole / len(checks) + rows


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["zero3", "fsdp2"])
@pytest.mark.parametrize("name", ["lomo", "adalomo"])
def test_sharded_accumulation_equals_one_process(accumulation_run, checks, engine, name):
    saved = torch.load(accumulation_run / f"{engine}_{name}.pt")
    model, opt, seen = one_process_seen(name, saved, ACCUMULATING)
    assert opt.step_count == STEPS + 1
    assert_within_update_tolerance(saved["final"], model.state_dict(), saved["initial"])
    assert_buffers_are_the_slices(checks, f"{engine}_{name}", model, int8=False)
    norms = [rank[f"{engine}_{name}"]["norms"] for rank in checks]
    assert norms[0] == norms[1]  # one all-reduced norm: the same step on every rank
    # Every step's accumulated norm, the short one's included: the same rounding effects as
    # the parameters'.
    assert norms[0] == pytest.approx(seen["norms"], rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["zero3", "fsdp2"])
def test_sharded_8_bit_buffer_follows_one_process(accumulation_run, checks, engine):
    # Each rank's 8-bit buffer holds its slice's blocks, cut at the slice's edges, and the
    # sharded gradients differ from one process's in their last bits. Each run's buffer is
    # the exact sum plus one stochastic rounding error per micro-batch, smaller than the step
    # (scale) its block took then and of mean zero: per element s, one process's recorded
    # step, and at most 2 s for a slice (a part of a block has at most its largest value, and
    # the gradients' last bits may lift that over a power of two).
    saved = torch.load(accumulation_run / f"{engine}_lomo_int8.pt")
    model, _, seen = one_process_seen("lomo", saved, ACCUMULATING_INT8)
    ranks = [rank[f"{engine}_lomo_int8"] for rank in checks]
    assert_buffers_are_the_slices(checks, f"{engine}_lomo_int8", model, int8=True)
    assert ranks[0]["norms"] == ranks[1]["norms"]
    got_norms = ranks[0]["norms"]
    assert len(got_norms) == len(seen["norms"]) == STEPS + 1

    def steps_of(t: int, name: str, power: int = 1) -> torch.Tensor:
        """Per element of `name`: the sum of the steps (or their squares) of step t's
        roundings."""
        blocks = sum(s[name] ** power for step, s in seen["scales"] if step == t)
        return blocks[torch.arange(seen["values"][t][name].numel()) // INT8_BLOCK]

    # Each step's norm: with b one process's buffer (and g its exact sum), |a|**2 - |b|**2 =
    # 2 <g, e_a - e_b> + |e_a|**2 - |e_b|**2. Per element the rounding errors of successive
    # micro-batches are uncorrelated, each of variance at most (step / 2)**2 (the two runs'
    # possibly correlated: e_a - e_b of standard deviation at most s + s / 2). The first
    # term: mean zero, variance at most 4 sum g**2 (1.5 s)**2, taken within 6 standard
    # deviations. |e_a|**2 and |e_b|**2: means of at most sum s**2 and sum s**2 / 4, and as
    # sums of independent elements, each within [0, (2 s)**2] (s summed over the roundings
    # first), within 6 sqrt(sum (2 s)**4) of them. Over |a| + |b| for the norms; plus the
    # gradients' own last bits (1e-4 relative, as for the other buffers).
    for t, (got, expected) in enumerate(zip(got_norms, seen["norms"], strict=True)):
        variance = squares = fourth = 0.0
        for name, b in seen["values"][t].items():
            variance += 4 * (b**2 * 1.5**2 * steps_of(t, name, 2)).sum().item()
            squares += steps_of(t, name, 2).sum().item()
            fourth += (2 * steps_of(t, name)).pow(4).sum().item()
        errors = 6 * variance**0.5 + squares + 6 * fourth**0.5
        bound = errors / (got + expected) + 1e-4 * expected
        assert abs(got - expected) <= bound, (t, got, expected, bound)

    # Each element: step t moves it by lr c_t times its buffer, c_t the clip coefficient
    # (max_norm / norm: the runs' coefficients differ by r_t = |their norms' difference| /
    # the sharded norm, relative), so the runs' parameters differ by at most the sum over
    # the steps of lr c_t ((1 + r_t) 3 s + r_t |b|) (s summed over the step's roundings),
    # plus 1e-4 of the tensor's largest update for the fp32 effects the other buffers' runs
    # are held to (the gradients' last bits, later gradients moved by earlier differences).
    # Blocks that got no gradient (the embedding's unused rows) are held to that last term.
    worst = 0.0
    for name, param in model.named_parameters():
        expected, got = param.detach().double().reshape(-1), saved["final"][name].double()
        initial = saved["initial"][name].double().reshape(-1)
        bound = 1e-4 * (expected - initial).abs().max().item()
        for t, coef in enumerate(seen["coefs"]):
            r = abs(got_norms[t] - seen["norms"][t]) / got_norms[t]
            moved = (1 + r) * 3 * steps_of(t, name) + r * seen["values"][t][name].abs()
            bound = bound + LR["lomo"] * coef * moved
        error = (got.reshape(-1) - expected).abs()
        worst = max(worst, (error / bound).max().item())
    assert worst <= 1.0, f"an element off by {worst:.2f} of its bound"


ADALOMO_INT8_RUNS = ("adalomo_int8", "adalomo_int8_batched")


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["zero3", "fsdp2"])
def test_sharded_8_bit_buffers_dequantised_one_bucket_at_a_time(accumulation_run, checks, engine):
    # AdaLomo reads an 8-bit buffer dequantised into a transient: the step from the buffers
    # hands the update batches of at most bucket_numel elements (here 1: a parameter each),
    # so one bucket of transients exists at a time, and steps as one batch of all does (the
    # ZeRO-3 run's smaller buckets also reorder its reduce-scatters: the sharded runs' bound).
    params = len(dict(ScaledLlama().named_parameters()))
    whole, batched = (checks[0][f"{engine}_{name}"] for name in ADALOMO_INT8_RUNS)
    assert whole["batch_sizes"] == [params] * (STEPS + 1)
    assert batched["batch_sizes"] == [1] * (params * (STEPS + 1))
    one, cut = (torch.load(accumulation_run / f"{engine}_{n}.pt") for n in ADALOMO_INT8_RUNS)
    assert_within_update_tolerance(cut["final"], one["final"], one["initial"])


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["zero3", "fsdp2"])
def test_sharded_checkpoint_mid_accumulation_is_refused_on_every_rank(checks, engine):
    for rank in checks:
        seen = rank[f"{engine}_lomo"]
        assert seen["step_count"] == STEPS + 1
        refused = seen["refused_mid_step"]
        assert "1 micro-batch accumulated and not applied (a step is 4)" in refused
        # Nothing changed (shards, moments, reports, the buffers): the micro-batch still
        # waits, until zero_grad() drops it.
        assert seen["changed_by_refusal"] is None, seen["changed_by_refusal"]
        assert seen["pending_after_refusal"] == 1
        assert seen["pending_after_zero_grad"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["exp_avg_sq_row", "exp_avg_sq"])
@pytest.mark.parametrize("steps", [1, 2])
@pytest.mark.parametrize("engine", ["zero3", "fsdp2"])
def test_sharded_adalomo_damaged_moments_refused_before_any_change(checks, engine, steps, entry):
    """A moment of the wrong size (a row factor R, whole on every rank, or a 1-D slice's v),
    accumulation_steps 1 and 2: the call that would apply the step (given lr=0.5) is refused
    on every rank with a ValueError naming the parameter and the entry, before any change to
    the local shards, the moments or the groups' lr; the step's micro-batches are dropped."""
    for rank in checks:
        seen = rank[f"damaged_{engine}_{steps}_{entry}"]
        assert seen["error"] is not None and seen["error"].startswith("ValueError: "), seen
        assert "of parameter 'llama." in seen["error"] and repr(entry) in seen["error"]
        assert "load a state_dict" in seen["error"]  # what to do
        assert seen["changed"] is None, seen["changed"]
        assert seen["lr"] == [LR["adalomo"]] and seen["pending"] == 0


def train_through_a_skipped_step(model, opt, batch_of, steps=None):
    """The worker's overflow run in one process: a clean step (batches 100..), a step whose
    POISONED_MICRO_BATCH-th loss is inf (batches 0..k-1: skipped whole, nothing changed),
    then a clean step (batches k..2k-1)."""
    k = opt.accumulation_steps

    def step(first: int, poisoned: int | None = None) -> None:
        for i in range(k):
            loss = model(batch_of(first + i)) / k
            opt.fused_backward(loss * float("inf") if i == poisoned else loss)

    step(100)
    before = snapshot(model)
    step(0, POISONED_MICRO_BATCH)
    assert same_bits(before, snapshot(model)) and opt.step_count == 2
    with pytest.warns(RuntimeWarning, match="skipped whole"):
        opt.flush_report()
    assert opt.last_step_skipped
    step(k)
    opt.flush_report()
    assert opt.step_count == 3 and not opt.last_step_skipped


@pytest.mark.slow
@pytest.mark.parametrize("label", OVERFLOW_RUNS)
@pytest.mark.parametrize("engine", ["zero3", "fsdp2"])
def test_sharded_overflow_on_one_rank_skips_the_accumulated_step_on_every_rank(
    accumulation_run, checks, engine, label
):
    """An inf in one element of one micro-batch's gradient on one rank's slice only (the
    other rank's buffers are finite): every rank skips the whole step (no shard or moment
    changed, bit for bit), reports it skipped at the next call, lowers an fp16 scale once;
    the buffers start afresh, so the next step equals one process's after the same skip."""
    ranks = [rank[f"overflow_{engine}_{label}"] for rank in checks]
    assert sorted(r["inf_in_buffer"] for r in ranks) == [False, True]  # one rank's slice
    for r in ranks:
        assert not r["first_skipped"]  # the clean step before: an fp16 scale that fits
        assert r["unchanged"]  # this rank's shards, bit for bit
        assert r["moments_unchanged"]
        assert (r["moments"] > 0) == label.startswith("adalomo")
        assert r["step_count"] == 2 and r["pending"] == 0
        assert r["reported_skipped"]  # at the next call, before its backward
        assert not r["clean_skipped"] and r["clean_updates"] and r["clean_step_count"] == 3
        if label.endswith("fp16"):
            assert r["scale_before"] == r["scale_initial"]
            # Lowered once by the skipped step; the clean step leaves it there.
            assert r["scale_after_skip"] == r["scale_before"] / 2 == r["scale_after_clean"]
        else:
            assert r["scale_before"] is None
    name, dtype, options = OVERFLOW_RUNS[label]
    if dtype == torch.float32:  # compared with one process (the fp16 run on the ranks only)
        saved = torch.load(accumulation_run / f"overflow_{engine}_{label}.pt")
        model, _ = one_process(
            name, saved["initial"], 3, train_fn=train_through_a_skipped_step, options=options
        )
        assert_within_update_tolerance(saved["final"], model.state_dict(), saved["initial"])


def one_step(model, opt, batch_of, steps=None):
    """One step of k micro-batches (batches 0..k-1), each loss / k."""
    k = opt.accumulation_steps
    for i in range(k):
        opt.fused_backward(model(batch_of(i)) / k)
    opt.flush_report()
    assert opt.step_count == 1 and opt.pending_micro_batches == 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lomo", "adalomo"])
def test_fsdp2_micro_batch_refused_between_pending_ones_leaves_no_trace(
    accumulation_run, checks, name
):
    """accumulation_steps=4 under FSDP2: two micro-batches pending, then one with gradient
    sync off, refused before its backward reaches a buffer: the pending ones kept (count and
    buffers), nothing else changed, on every rank; with sync back on, the step's last two
    micro-batches make one process's step from the same four."""
    for rank in checks:
        seen = rank[f"refused_between_pending_{name}"]
        assert "gradient synchronisation is off" in seen["error"]
        assert "2 pending kept" in seen["notes"] and "no parameter was changed" in seen["notes"]
        assert seen["pending_before"] == seen["pending_after"] == 2
        assert seen["changed"] is None, seen["changed"]  # parameters, buffers, state: bits
        assert seen["step_count"] == 0
        assert seen["final_step_count"] == 1 and seen["final_pending"] == 0
    saved = torch.load(accumulation_run / f"refused_between_{name}.pt")
    model, _ = one_process(name, saved["initial"], 1, train_fn=one_step, options=ACCUMULATING)
    assert_within_update_tolerance(saved["final"], model.state_dict(), saved["initial"])
