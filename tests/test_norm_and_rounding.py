"""grad_sumsq_, clip_coef_from_sumsq and stochastic rounding on every backend."""

from __future__ import annotations

import math

import pytest
import torch
from float64_reference import sumsq_rel_bound

from lomo_kernels import ops

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


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
    assert ops.clip_coef_from_sumsq(torch.tensor([4.0]), 1.0).item() == pytest.approx(
        1.0 / (2.0 + 1e-6)
    )
    assert ops.clip_coef_from_sumsq(torch.tensor([0.25]), 1.0).item() == 1.0
    with pytest.raises(ValueError, match="max_norm"):
        ops.clip_coef_from_sumsq(torch.tensor([1.0]), 0.0)


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


def test_stochastic_rounding_unbiased_over_seeds(backend):
    # The same element across many seeds: also unbiased (seed decorrelates steps).
    draws = torch.stack([_sr_step(backend, 8, seed=s) for s in range(400)]).double()
    p_up = (draws > 1.0).double().mean().item()
    assert abs(p_up - 0.3) <= 5 * math.sqrt(0.3 * 0.7 / draws.numel())


def test_stochastic_rounding_reproducible(backend):
    a = _sr_step(backend, 4097, seed=7)
    b = _sr_step(backend, 4097, seed=7)
    c = _sr_step(backend, 4097, seed=8)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_stochastic_rounding_same_bits_on_every_backend():
    for step in (None, 0, 12345, 2**40 + 3):
        outs = [_sr_step(name, 4099, seed=99, step=step) for name in ("torch", "cpp", "triton")]
        for out in outs[1:]:
            assert torch.equal(out.view(torch.int16), outs[0].view(torch.int16))


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
    draws = torch.stack([_sr_step(backend, 8, seed=5, step=s) for s in range(400)]).double()
    p_up = (draws > 1.0).double().mean().item()
    assert abs(p_up - 0.3) <= 5 * math.sqrt(0.3 * 0.7 / draws.numel())


def test_stochastic_rounding_keeps_exact_values_and_specials(backend):
    # A result that is exactly representable in bf16 must never move.
    param = torch.tensor([1.0, -2.0, 0.5, 0.0], dtype=torch.bfloat16)
    grad = torch.zeros(4)
    for seed in range(20):
        out = param.clone()
        ops.fused_sgd_update_(
            out, grad, lr=1.0, stochastic_rounding=True, seed=seed, backend=backend
        )
        assert torch.equal(out, param)
