"""Stochastic rounding of the write-back into bf16 and fp16 parameters: the rounding itself
against float64 neighbours, the AdaLomo op on every backend (unbiased, the two neighbours
only, the same draws everywhere), the refusal of fp32 parameters, and the optimizers'
defaults. The LOMO op's stochastic rounding: test_lomo_update.py."""

from __future__ import annotations

import math

import pytest
import torch
from support.rounding import LOW, neighbour_counts

from lomo_kernels import AdaLomo, Lomo, ops
from lomo_kernels.core.rounding import fp16_stochastic, random_bits16, round_to_dtype

ALL_RANDOM16 = torch.arange(1 << 16, dtype=torch.int64)


def neighbours(x: float, dtype: torch.dtype) -> tuple[float, float]:
    """(lower, upper) values of `dtype` around `x` in magnitude, in float64: found by
    stepping the bit pattern of the nearest value (no rounding rule of ours involved)."""
    near = torch.tensor([x], dtype=torch.float64).to(dtype)
    bits = near.view(torch.int16).to(torch.int32) & 0xFFFF
    values = [
        torch.tensor([(int(bits) + d) & 0xFFFF], dtype=torch.int32).to(torch.int16).view(dtype)
        for d in (-1, 0, 1)
    ]
    mags = sorted({abs(float(v)) for v in values} | {abs(float(near))})
    lower = max(m for m in mags if m <= abs(x))
    upper = min(m for m in mags if m >= abs(x))
    return lower, upper


# Values across the fp16 range: normals of every exponent region, subnormals (below 2^-14),
# the smallest subnormal's neighbourhood, the top of the range, both signs.
FP16_CASES = [
    1.0 + 0.3 * 2**-10,
    -3.14159,
    1234.567,
    65000.3,
    65503.9,
    2**-14 + 2**-30,
    2**-14 - 2**-30,
    3.3e-6,
    -4.1e-7,
    1.5 * 2**-24,
    0.6 * 2**-24,
    0.3 * 2**-24,
    1e-20,
]


@pytest.mark.parametrize("x", FP16_CASES, ids=lambda x: f"{x:.3g}")
def test_fp16_rounds_up_with_the_distance_to_the_lower_neighbour(x):
    """Over all 2^16 random values, x rounds to its two float64-found neighbours only, and
    up exactly floor(2^16 * frac) times, frac = (|x| - lower) / (upper - lower): unbiased to
    within 2^-16 of a spacing (exactly, where frac has at most 16 bits: every normal)."""
    value = torch.tensor([x], dtype=torch.float32)
    exact = float(value)  # the fp32 value is what the kernels round
    lower, upper = neighbours(exact, torch.float16)
    out = fp16_stochastic(value.expand(1 << 16), ALL_RANDOM16).to(torch.float16).double()
    magnitudes = set(out.abs().unique().tolist())
    assert magnitudes <= {lower, upper}
    assert bool((torch.sign(out) * math.copysign(1, exact) >= 0).all())  # sign kept
    if upper == lower:
        assert magnitudes == {lower}
        return
    frac = (abs(exact) - lower) / (upper - lower)
    ups = int((out.abs() == upper).sum())
    assert ups == math.floor(frac * 65536)


def test_fp16_beyond_the_range_and_specials_round_as_the_cast():
    values = torch.tensor(
        [65504.0, 65519.0, 65520.0, 1e6, float("inf"), -float("inf"), float("nan"), -0.0, 0.0]
    )
    for r in (0, 1, 12345, 65535):
        out = fp16_stochastic(values, torch.full(values.shape, r, dtype=torch.int64))
        expected = values.to(torch.float16)
        got = out.to(torch.float16)
        assert torch.equal(got.view(torch.int16)[:6], expected.view(torch.int16)[:6])
        assert bool(got[6].isnan())
        assert torch.equal(got[7:].view(torch.int16), expected[7:].view(torch.int16))


def test_bf16_rounds_up_with_the_distance_to_the_lower_neighbour():
    for x in (1.0 + 0.3 * 2**-7, -2.7182, 3.0e-30, 1e38):
        value = torch.tensor([x], dtype=torch.float32)
        exact = float(value)
        lower, upper = neighbours(exact, torch.bfloat16)
        random16 = ALL_RANDOM16
        out = round_to_dtype(value.expand(1 << 16), torch.bfloat16, random16).double()
        frac = (abs(exact) - lower) / (upper - lower)
        assert set(out.abs().unique().tolist()) <= {lower, upper}
        assert int((out.abs() == upper).sum()) == round(frac * 65536)  # 16 dropped bits


def test_random_bits_are_uniform_over_indices():
    """The 16 bits per element index are uniform: each of 16 buckets of 2^16 draws holds
    about a sixteenth (chi-square, 15 degrees of freedom, far below its 0.1% point 37.7)."""
    bits = random_bits16(torch.arange(1 << 16, dtype=torch.int64), 12345)
    counts = torch.bincount(bits >> 12, minlength=16).double()
    expected = (1 << 16) / 16
    assert float(((counts - expected) ** 2 / expected).sum()) < 37.7


# ----------------------------------------------------------------------------- the ops


def _adalomo_step(param, grad, backend, **kwargs):
    state = {}
    # lr 1e-4: relative updates of about 1e-4, below half a spacing of bf16 and fp16.
    ops.adalomo_update_(param, grad, state, lr=1e-4, beta2=0.5, backend=backend, **kwargs)


@pytest.mark.parametrize("shape", [(37, 1031), (4097,)], ids=["37x1031", "4097"])
@pytest.mark.parametrize("dtype", LOW.values(), ids=LOW.keys())
def test_adalomo_update_rounds_each_element_to_a_neighbour_without_bias(backend, dtype, shape):
    """AdaLomo's write-back, factored and 1-D: each element on a neighbour of the fp32
    step's result (the same step on an fp32 copy of the weights), up as often as the
    fractions say within 5 standard deviations; round-to-nearest without the option."""
    gen = torch.Generator().manual_seed(2)
    param = torch.randn(shape, generator=gen).to(dtype)
    grad = torch.randn(shape, generator=gen)
    exact = param.float()
    _adalomo_step(exact, grad, "torch")
    out = param.clone()
    _adalomo_step(out, grad, backend, stochastic_rounding=True, seed=11)
    ups, expected, variance = neighbour_counts(out.reshape(-1), exact.reshape(-1), dtype)
    assert abs(ups - expected) <= 5 * math.sqrt(variance)
    assert ups > 0  # the updates are below half a spacing: nearest would drop most
    nearest = param.clone()
    _adalomo_step(nearest, grad, backend)
    moved = float((nearest != param).double().mean())
    assert moved < float((out != param).double().mean())


@pytest.mark.parametrize("dtype", LOW.values(), ids=LOW.keys())
@pytest.mark.parametrize("shape", [(37, 1031), (278011,)], ids=["37x1031", "278011"])
def test_adalomo_stochastic_rounding_same_draws_on_every_backend(dtype, shape):
    """Every backend draws the same bits per element: the outputs agree except where the
    backends' fp32 results differ (AdaLomo's scales go through a square root that torch's
    vectorised CPU sqrt may round 1 ulp off, so the fp32 values can differ by an ulp or so):
    an element then lands on the other neighbour only if its draw falls within that ulp,
    about 2^-13 of a spacing for fp16 and 2^-16 for bf16. Mismatches are one spacing apart
    and fewer than 0.1% of the elements."""
    gen = torch.Generator().manual_seed(3)
    param = torch.randn(shape, generator=gen).to(dtype)
    grad = torch.randn(shape, generator=gen)
    step = torch.tensor([77], dtype=torch.int64)
    outs = []
    for name in ("torch", "cpp", "triton"):
        out = param.clone()
        _adalomo_step(out, grad, name, stochastic_rounding=True, seed=5, seed_step=step)
        outs.append(out.reshape(-1).view(torch.int16).to(torch.int32))
    for out in outs[1:]:
        differ = out != outs[0]
        assert int(differ.sum()) <= out.numel() // 1000
        assert bool(((out[differ] - outs[0][differ]).abs() == 1).all())


def test_stochastic_rounding_of_fp32_is_refused_before_any_change():
    param = torch.ones(4)
    with pytest.raises(ValueError, match="stochastic_rounding applies to bfloat16 and float16"):
        ops.fused_sgd_update_(param, torch.ones(4), lr=0.1, stochastic_rounding=True)
    with pytest.raises(ValueError, match="stochastic_rounding applies to bfloat16 and float16"):
        _adalomo_step(param, torch.ones(4), None, stochastic_rounding=True)
    assert torch.equal(param, torch.ones(4))


# ----------------------------------------------------------------------------- optimizers


def _tiny(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Tanh(), torch.nn.Linear(48, 1)).to(
        dtype
    )


@pytest.mark.parametrize("cls", [Lomo, AdaLomo])
def test_default_keeps_small_updates_that_nearest_drops(cls):
    """At a fine-tuning lr, bf16 weights with the default constructor follow the fp32
    weights' trajectory, while round-to-nearest (lomo-optim's) leaves most weights where
    they were: after 30 steps, the distance to the fp32 run's weights."""
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    lr = 3e-3 if cls is Lomo else 1e-3

    def train(dtype, **kwargs):
        model = _tiny(dtype)
        opt = cls(model, lr=lr, **kwargs)
        for _ in range(30):
            opt.fused_backward(model(x.to(dtype)).float().pow(2).mean())
        return torch.cat([p.detach().double().reshape(-1) for p in model.parameters()])

    start = torch.cat([p.detach().double().reshape(-1) for p in _tiny(torch.bfloat16).parameters()])
    exact = train(torch.float32)
    stochastic = train(torch.bfloat16)
    nearest = train(torch.bfloat16, stochastic_rounding=False)
    # How far each bf16 run got along the fp32 run's displacement.
    direction = exact - start.to(exact)
    progress = {
        name: float((run - start) @ direction / (direction @ direction))
        for name, run in (("stochastic", stochastic), ("nearest", nearest))
    }
    # Stochastic rounding is unbiased: its progress is 1 up to the rounding noise (0.98 for
    # Lomo, 0.99 for AdaLomo seen here); nearest loses every update below half a spacing
    # (0.51 and 0.33 seen). The thresholds sit midway, far from both.
    assert progress["stochastic"] > 0.8
    assert progress["nearest"] < progress["stochastic"] - 0.2
