"""The fused LOMO update (`fused_sgd_update_`) and its norm ops (`grad_sumsq_`,
`clip_coef_from_sumsq`) on every backend: against an independent float64 model, the
non-finite and skip flags, and stochastic rounding of bf16 and fp16 parameters (unbiased,
reproducible, the same bits on every backend). Backend-specific checks (bit-exactness
against the reference, vector levels, GPU code) are in tests/kernels."""

from __future__ import annotations

import math

import pytest
import torch
from support.float64 import assert_within_ulp, lomo_update_f64, sumsq_rel_bound
from support.lomo_update import DTYPES, LR, OPTIONS, SIZES, bound_kwargs, make_inputs
from support.rounding import LOW, assert_unbiased_neighbours
from support.state import same_bits

from lomo_kernels import ops

BACKENDS = ("torch", "cpp", "triton")


# ----------------------------------------------------------------------------- float64 model


def check_update(backend, n, param_dtype, grad_dtype, options, *, as_tensors=False):
    """One update on `backend` within the float64 model's bound; `as_tensors`: lr, inv_scale
    and clip_coef given as device tensors."""
    param, grad = make_inputs(n, param_dtype, grad_dtype, inv_scale=options.get("inv_scale", 1.0))
    ref, bad, lr_g = lomo_update_f64(param, grad, lr=LR, **options)
    assert not bad.any()
    kwargs = dict(options)
    lr = LR
    if as_tensors:
        lr = torch.tensor([LR])
        for key in ("inv_scale", "clip_coef"):
            if key in kwargs:
                kwargs[key] = torch.tensor([kwargs[key]])
    found_inf = torch.zeros(1)
    original = param.clone()
    ops.fused_sgd_update_(param, grad, lr=lr, found_inf=found_inf, backend=backend, **kwargs)
    assert found_inf.item() == 0.0
    assert_within_ulp(param, ref, param_dtype, **bound_kwargs(param_dtype, original, lr_g))


@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("grad_dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("param_dtype", DTYPES.values(), ids=DTYPES.keys())
def test_all_options_every_dtype_and_size(backend, param_dtype, grad_dtype, n):
    check_update(backend, n, param_dtype, grad_dtype, OPTIONS["all"])


@pytest.mark.parametrize("option", OPTIONS.keys())
@pytest.mark.parametrize("grad_dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("param_dtype", DTYPES.values(), ids=DTYPES.keys())
def test_each_option_alone(backend, param_dtype, grad_dtype, option):
    check_update(backend, 4097, param_dtype, grad_dtype, OPTIONS[option])


@pytest.mark.parametrize("param_dtype", DTYPES.values(), ids=DTYPES.keys())
def test_device_tensor_scalars(backend, param_dtype):
    check_update(backend, 278011, param_dtype, torch.bfloat16, OPTIONS["all"], as_tensors=True)


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")], ids=str)
@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("n", [7, 4097, 278011], ids=lambda n: f"n{n}")
@pytest.mark.parametrize(
    "dtypes", [("bf16", "bf16"), ("fp16", "fp16"), ("fp32", "fp32"), ("bf16", "fp32")], ids="-".join
)
def test_non_finite_gradient_elements(backend, dtypes, n, where, value):
    param_dtype, grad_dtype = DTYPES[dtypes[0]], DTYPES[dtypes[1]]
    param, grad = make_inputs(n, param_dtype, grad_dtype)
    index = {"first": 0, "middle": n // 2, "last": n - 1}[where]
    grad[index] = value
    ref, bad, lr_g = lomo_update_f64(param, grad, lr=LR, **OPTIONS["all"])
    original = param.clone()
    found_inf = torch.zeros(1)
    ops.fused_sgd_update_(
        param, grad, lr=LR, found_inf=found_inf, backend=backend, **OPTIONS["all"]
    )
    assert found_inf.item() == 1.0
    # The poisoned element keeps its exact bits (clamping must not launder inf into a step).
    assert torch.equal(
        param.view(-1)[index : index + 1].view(torch.uint8),
        original.view(-1)[index : index + 1].view(torch.uint8),
    )
    assert torch.isfinite(param).all()
    assert_within_ulp(
        param, ref, param_dtype, mask=~bad, **bound_kwargs(param_dtype, original, lr_g)
    )


@pytest.mark.parametrize(
    "dtypes", [("bf16", "bf16"), ("fp16", "fp32"), ("fp32", "fp16")], ids="-".join
)
@pytest.mark.parametrize("explicit_skip", [False, True], ids=["found_inf", "skip_if"])
def test_preset_flag_writes_nothing(backend, dtypes, explicit_skip):
    param, grad = make_inputs(4097, DTYPES[dtypes[0]], DTYPES[dtypes[1]])
    grad[5] = float("nan")
    original = param.clone()
    found_inf = torch.ones(1)
    skip_if = torch.full((1,), 3.0) if explicit_skip else None
    ops.fused_sgd_update_(
        param, grad, lr=LR, found_inf=found_inf, skip_if=skip_if, backend=backend, weight_decay=0.1
    )
    assert torch.equal(param.view(torch.uint8), original.view(torch.uint8))
    assert found_inf.item() == 1.0


def test_skip_if_zero_updates_and_records(backend):
    param, grad = make_inputs(4097, torch.bfloat16, torch.bfloat16)
    grad[-1] = float("inf")
    before = param.clone()
    found_inf, skip_if = torch.zeros(1), torch.zeros(1)
    ops.fused_sgd_update_(param, grad, lr=LR, found_inf=found_inf, skip_if=skip_if, backend=backend)
    assert found_inf.item() == 1.0 and skip_if.item() == 0.0
    assert not torch.equal(param[:-1], before[:-1])


def test_bf16_round_to_nearest_even_ties(backend):
    # p = 1 + k*2^-8 lies exactly halfway between bf16 neighbours 1 + k*2^-7 (ties to even).
    k = torch.arange(64, dtype=torch.float32)
    exact = 1.0 + (2 * k + 1) * 2.0**-8
    param = torch.ones(64, dtype=torch.bfloat16)
    grad = (1.0 - exact) / 1.0  # lr 1: p - g = exact
    ops.fused_sgd_update_(param, grad, lr=1.0, backend=backend)
    expected = torch.tensor(exact.tolist(), dtype=torch.float64).to(torch.bfloat16)
    assert torch.equal(param, expected)


# bf16 nan parameters: quiet and signalling (bit 6 clear), both signs, payload bit 0 clear.
BF16_NANS = [0x7FC0, 0xFFC0, 0x7FA0, 0xFF82, 0x7FFE]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy's, Triton
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_bf16_nan_parameters_stay_their_quiet_nans(backend, stochastic):
    # A nan parameter with a finite gradient is written back (only a non-finite gradient
    # keeps its element): fp32 arithmetic on the CPU keeps the nan's sign and payload and
    # sets its quiet bit, and the write-back keeps the top 16 bits with the quiet bit set
    # (core/rounding.py), so the stored bits are the parameter's own with bit 6 set.
    nans = torch.tensor(BF16_NANS, dtype=torch.int32).to(torch.int16)
    finite = torch.tensor([1.0, -3.0, 0.25], dtype=torch.bfloat16)
    param = torch.cat([nans.view(torch.bfloat16), finite]).repeat(5)  # 40: a vector trip and a tail
    grad = torch.linspace(-1.0, 1.0, param.numel())
    original = param.clone()
    ops.fused_sgd_update_(param, grad, lr=0.5, weight_decay=0.1, stochastic_rounding=stochastic,
                          seed=3, backend=backend)  # fmt: skip
    was_nan = original.isnan()
    assert torch.equal(param.isnan(), was_nan)
    quiet = original.view(torch.int16)[was_nan] | 0x40
    assert torch.equal(param.view(torch.int16)[was_nan], quiet)


# ----------------------------------------------------------------------------- norm ops


@pytest.mark.parametrize("n", [1, 7, 16, 4097, 278011], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("grad_dtype", DTYPES.values(), ids=DTYPES.keys())
def test_sumsq_matches_float64(backend, grad_dtype, n):
    grad = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 1024).to(grad_dtype)
    sumsq = torch.full((1,), 3.0)
    found_inf = torch.zeros(1)
    ops.grad_sumsq_(grad, sumsq, inv_scale=2.0**-10, found_inf=found_inf, backend=backend)
    expected = 3.0 + ((grad.double() * 2.0**-10) ** 2).sum().item()
    assert math.isclose(sumsq.item(), expected, rel_tol=sumsq_rel_bound(backend, n))
    assert found_inf.item() == 0.0


@pytest.mark.parametrize("value", [float("inf"), float("nan")], ids=str)
def test_sumsq_flags_non_finite(backend, value):
    grad = torch.randn(4097, dtype=torch.bfloat16)
    grad[4096] = value
    sumsq, found_inf = torch.zeros(1), torch.zeros(1)
    ops.grad_sumsq_(grad, sumsq, found_inf=found_inf, backend=backend)
    assert found_inf.item() == 1.0


def test_sumsq_tensor_inv_scale(backend):
    grad = torch.randn(300, dtype=torch.float16)
    sumsq = torch.zeros(1)
    ops.grad_sumsq_(grad, sumsq, inv_scale=torch.tensor([0.25]), backend=backend)
    expected = ((grad.double() * 0.25) ** 2).sum().item()
    assert math.isclose(sumsq.item(), expected, rel_tol=sumsq_rel_bound(backend, grad.numel()))


def test_clip_coef_from_sumsq():
    # lomo-optim's and torch's min(1, max_norm / (norm + 1e-6)), in fp32: the eps shows at a
    # norm of 2 as 1 / (2 + 1e-6) in fp32 (not 1/2), and decides the coefficient at a norm
    # far below it (1e-8: 0.5 / (1e-8 + 1e-6), not 1).
    def fp32(x: float) -> float:
        return torch.tensor(x, dtype=torch.float32).item()

    def coef(sumsq: float, max_norm: float) -> float:
        return ops.clip_coef_from_sumsq(torch.tensor([sumsq]), max_norm).item()

    assert coef(4.0, 1.0) == fp32(1.0 / fp32(2.0 + 1e-6)) != 0.5
    assert coef(1e-16, 5e-7) == pytest.approx(5e-7 / (1e-8 + 1e-6), rel=1e-6)
    assert coef(0.25, 1.0) == 1.0 and coef(0.0, 1.0) == 1.0
    with pytest.raises(ValueError, match="max_norm"):
        ops.clip_coef_from_sumsq(torch.tensor([1.0]), 0.0)


# ----------------------------------------------------------------------------- stochastic rounding


def _sr_step(backend, n, seed, value=1.0, delta=0.3 * 2.0**-7, step=None):
    """bf16 param at `value`, updated by `delta` (a fraction of a bf16 ulp) with SR; `step`:
    the per-step part of the seed, passed as a device tensor."""
    param = torch.full((n,), value, dtype=torch.bfloat16)
    grad = torch.full((n,), -delta, dtype=torch.float32)
    seed_step = None if step is None else torch.tensor([step], dtype=torch.int64)
    ops.fused_sgd_update_(
        param,
        grad,
        lr=1.0,
        stochastic_rounding=True,
        seed=seed,
        seed_step=seed_step,
        backend=backend,
    )
    return param


def test_stochastic_rounding_unbiased(backend):
    n = 1 << 16
    exact = 1.0 + 0.3 * 2.0**-7  # 30% of the way to the next bf16 value (ulp 2^-7 at 1)
    out = _sr_step(backend, n, seed=1234).double()
    assert set(out.unique().tolist()) == {1.0, 1.0 + 2.0**-7}
    # Each element rounds up with probability 0.3: the mean's standard error is
    # sqrt(0.3 * 0.7 / n) ulp; accept 5 standard errors.
    p_up = (out > 1.0).double().mean().item()
    assert abs(p_up - 0.3) <= 5 * math.sqrt(0.3 * 0.7 / n)
    assert abs(out.mean().item() - exact) <= 5 * math.sqrt(0.3 * 0.7 / n) * 2.0**-7


DRAWS = 400
# The Triton interpreter takes tens of milliseconds a call: 400 draws would take 18 s. Every
# backend draws the same bits from the same seed, step and index (the test below), so on
# Triton the draws are checked equal to the C++ backend's bit for bit where the seed's and
# the step's words differ, and the torch and C++ backends carry the statistics.
AGAINST_CPP = (0, 1, 2, DRAWS - 1, 2**32 + 3, 2**40 + 3, 2**63 - 1)


def assert_draws_unbiased(backend, draw) -> None:
    """`draw(backend, i)`: 8 elements 30% of a bf16 spacing below the next value after one
    stochastically rounded step; over DRAWS of them 30% round up, within 5 standard
    deviations. On Triton: the C++ backend's draws bit for bit (AGAINST_CPP)."""
    if backend == "triton":
        for i in AGAINST_CPP:
            assert same_bits([draw("triton", i)], [draw("cpp", i)]), i
        return
    draws = torch.stack([draw(backend, i) for i in range(DRAWS)]).double()
    p_up = (draws > 1.0).double().mean().item()
    assert abs(p_up - 0.3) <= 5 * math.sqrt(0.3 * 0.7 / draws.numel())


def test_stochastic_rounding_unbiased_over_seeds(backend):
    # The same element across many seeds: also unbiased (seed decorrelates steps).
    assert_draws_unbiased(backend, lambda name, seed: _sr_step(name, 8, seed=seed))


def test_stochastic_rounding_reproducible(backend):
    a = _sr_step(backend, 4097, seed=7)
    b = _sr_step(backend, 4097, seed=7)
    c = _sr_step(backend, 4097, seed=8)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_stochastic_rounding_same_bits_on_every_backend():
    for step in (None, 0, 12345, 2**40 + 3):
        outs = [_sr_step(name, 4099, seed=99, step=step) for name in BACKENDS]
        for out in outs[1:]:
            assert same_bits([out], outs[:1]), step


def test_stochastic_rounding_seed_step_streams(backend):
    # A fixed seed with a per-step tensor: reproducible, a new stream each step, and the
    # stream of the seed whose high half is XORed with the step (0: the seed alone).
    a = _sr_step(backend, 4097, seed=7, step=3)
    assert torch.equal(a, _sr_step(backend, 4097, seed=7, step=3))
    assert not torch.equal(a, _sr_step(backend, 4097, seed=7, step=4))
    assert not torch.equal(a, _sr_step(backend, 4097, seed=8, step=3))
    assert torch.equal(a, _sr_step(backend, 4097, seed=7 ^ (3 << 32)))
    assert torch.equal(_sr_step(backend, 4097, seed=7, step=0), _sr_step(backend, 4097, seed=7))


def test_stochastic_rounding_unbiased_over_steps(backend):
    # The same elements across many steps of one seed: unbiased, as over seeds.
    assert_draws_unbiased(backend, lambda name, step: _sr_step(name, 8, seed=5, step=step))


@pytest.mark.parametrize("dtype", LOW.values(), ids=LOW.keys())
def test_stochastic_rounding_keeps_exact_values_and_specials(backend, dtype):
    """A result exactly representable in the dtype never moves, bit for bit: ordinary values,
    -0.0, the largest finite value, a subnormal and +-inf; a nan stays a nan (its payload is
    the dtype conversions', which torch's fp16 widening does not keep)."""
    info = torch.finfo(dtype)
    values = [1.0, -2.0, 0.5, 0.0, -0.0, info.max, -info.max, info.smallest_normal / 2**3,
              math.inf, -math.inf, math.nan]  # fmt: skip
    param = torch.tensor(values, dtype=torch.float32).to(dtype)
    grad = torch.zeros(len(values))
    for seed in range(20):
        out = param.clone()
        ops.fused_sgd_update_(
            out, grad, lr=1.0, stochastic_rounding=True, seed=seed, backend=backend
        )
        assert torch.isnan(out[-1]), seed
        assert torch.equal(out[:-1].view(torch.int16), param[:-1].view(torch.int16)), seed


@pytest.mark.parametrize("dtype", LOW.values(), ids=LOW.keys())
def test_lomo_update_rounds_each_element_to_a_neighbour_without_bias(backend, dtype):
    """One fused update of 278011 elements with updates well below half a spacing: every
    element lands on a neighbour of its exact fp32 result, and the number rounded up is
    the sum of the fractions within 5 standard deviations (Bernoulli variances)."""
    gen = torch.Generator().manual_seed(1)
    n = 278011
    param = torch.randn(n, generator=gen).to(dtype)
    grad = torch.randn(n, generator=gen) * 1e-4
    exact = param.float() - 0.5 * grad  # the fp32 result (one rounding per op, as the op)
    out = param.clone()
    ops.fused_sgd_update_(out, grad, lr=0.5, stochastic_rounding=True, seed=3, backend=backend)
    assert_unbiased_neighbours(out, exact, dtype)
    nearest = param.clone()
    ops.fused_sgd_update_(nearest, grad, lr=0.5, backend=backend)
    # Without the option: torch's cast of the same fp32 value (round to nearest even).
    assert torch.equal(nearest.view(torch.int16), exact.to(dtype).view(torch.int16))


@pytest.mark.parametrize("dtype", LOW.values(), ids=LOW.keys())
def test_lomo_stochastic_rounding_same_bits_on_every_backend(dtype):
    gen = torch.Generator().manual_seed(4)
    param = torch.randn(278011, generator=gen).to(dtype)
    grad = torch.randn(278011, generator=gen) * 1e-3
    for step in (None, torch.tensor([2**40 + 3], dtype=torch.int64)):
        outs = []
        for name in BACKENDS:
            out = param.clone()
            ops.fused_sgd_update_(out, grad, lr=1.0, stochastic_rounding=True, seed=9,
                                  seed_step=step, backend=name)  # fmt: skip
            outs.append(out.view(torch.int16))
        for out in outs[1:]:
            assert torch.equal(out, outs[0])
