"""Gradient accumulation under ZeRO-3 and FSDP2 on 2 ranks (torchrun, gloo, CPU) against one
process with the same accumulation on the full micro-batches (full steps, then a short one
applied by opt.step()): each rank accumulates its reduced slices (a buffer of 1/W of each
parameter), measures its part of the accumulated norm, and every rank applies the same
step."""

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
from support.sharded_models import ACCUMULATING, ACCUMULATING_INT8, LR, STEPS, train_accumulating

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
    assert opt.step_count == STEPS + 1
    assert_within_update_tolerance(saved["final"], model.state_dict(), saved["initial"])
    # Each rank's buffers are its slices: together the model's parameters once (ZeRO-3 pads
    # each parameter's partition to a multiple of W elements), each rank's about 1/W of them.
    ranks = len(checks)
    params = [p for p in model.parameters() if p.requires_grad]
    whole = sum(p.numel() * p.element_size() for p in params)
    padding = sum((ranks - 1) * p.element_size() for p in params)
    held = [rank[f"{engine}_{name}"]["buffer_bytes"] for rank in checks]
    assert whole <= sum(held) <= whole + padding
    # A rank's slice of a parameter: at most one row (FSDP2's dim-0 chunks) or one element
    # (ZeRO-3) more than 1/W of it.
    rows = sum(p.element_size() * p.numel() // p.shape[0] for p in params)
    assert max(held) <= whole / ranks + rows
    norms = [rank[f"{engine}_{name}"]["norm"] for rank in checks]
    assert norms[0] == norms[1]  # one all-reduced norm: the same step on every rank
    # The accumulated gradient's norm: the same rounding effects as the parameters'.
    assert norms[0] == pytest.approx(float(opt.last_grad_norm), rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["zero3", "fsdp2"])
def test_sharded_8_bit_buffer_follows_one_process(accumulation_run, checks, engine):
    # Each rank's 8-bit buffer holds its slice's blocks, cut at the slice's edges (the small
    # tensors here split mid-block: two scales where one process has one), and the sharded
    # gradients differ from one process's in their last bits (an average over two half
    # batches), which moves a code by one step where a value sits at a rounding boundary.
    # Each such difference is at most one code step of its block per micro-batch and run
    # (a step at most doubles from one micro-batch to the next: 2 steps of the last), lr
    # times that, over the steps: the bound per tensor, from one process's last scales.
    saved = torch.load(accumulation_run / f"{engine}_lomo_int8.pt")
    model, opt = one_process(
        "lomo", saved["initial"], steps=STEPS, train_fn=train_accumulating,
        options=ACCUMULATING_INT8,
    )  # fmt: skip
    # The buffers stay allocated after the step: their last scales.
    scales = {id(p): b.scales.max().item() for p, b, _ in opt._accumulation._buffers.values()}
    k = ACCUMULATING["accumulation_steps"]
    worst = spread = 0.0
    for name, param in model.named_parameters():
        expected, got = param.detach().double(), saved["final"][name].double()
        largest_update = (expected - saved["initial"][name].double()).abs().max().item()
        step = LR["lomo"] * 2 * scales[id(param)]  # lr x a block's largest step
        bound = step * (STEPS + 1) * k * 2 + 1e-4 * largest_update
        worst = max(worst, (got - expected).abs().max().item() / bound)
        if param.numel() >= 1024:
            # The roundings are unbiased and independent: per element a variance of at most
            # step**2 / 4 per rounding, 2 runs x STEPS x k roundings; the root mean square
            # over the tensor within 3 times that standard deviation. (A micro-batch lost
            # or counted twice moves it by lr times the gradient's spread: far more.)
            rms = (got - expected).pow(2).mean().sqrt().item()
            spread = max(spread, rms / (3 * step / 2 * (2 * (STEPS + 1) * k) ** 0.5))
    assert worst <= 1.0, f"an element off by {worst:.2f} of its bound"
    assert spread <= 1.0, f"a tensor's differences spread {spread:.2f} of their bound"
    norms = [rank[f"{engine}_lomo_int8"]["norm"] for rank in checks]
    assert norms[0] == norms[1]
    # The last step's norm against one process's. Each run's buffer is the gradients' sum g
    # plus unbiased independent rounding errors, per element a variance of at most k s**2
    # (k roundings of a step at most 2 s, s the parameter's largest last scale), so
    # |a|**2 - |b|**2 = 2 <g, e_a - e_b> + |e_a|**2 - |e_b|**2 has a variance of at most
    # sum over parameters of 8 k s**2 |g_p|**2 + 4 n_p (k s**2)**2: within 6 of its standard
    # deviations, over |a| + |b| for the norms; plus the gradients' own last bits (1e-4
    # relative, as for the other buffers). A micro-batch lost moves the norm by far more.
    expected = float(opt.last_grad_norm)
    variance = 0.0
    for param, grad_norm in zip(model.parameters(), opt.grad_norms.tolist(), strict=True):
        s2 = scales[id(param)] ** 2
        variance += 8 * k * s2 * grad_norm**2 + 4 * param.numel() * (k * s2) ** 2
    bound = 6 * variance**0.5 / (2 * expected) + 1e-4 * expected
    assert abs(norms[0] - expected) <= bound


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["zero3", "fsdp2"])
def test_sharded_checkpoint_mid_accumulation_is_refused_on_every_rank(checks, engine):
    for rank in checks:
        seen = rank[f"{engine}_lomo"]
        assert seen["step_count"] == STEPS + 1
        assert "1 of 4 micro-batches accumulated" in seen["refused_mid_step"]
        assert seen["pending_after_zero_grad"] == 0
