"""`grad_accumulate_` (a micro-batch's gradient added into its accumulation buffer) on every
backend (torch reference, C++, Triton through its interpreter) against an independent float64
model (support/grad_accumulate.py): the stored values are the fp32 sum rounded to nearest even,
or stochastically to one of its two neighbours, unbiased and with the same bits on every
backend; the sum of squares and the inf/nan flag are those of the stored values. The CPU
levels and the bit-for-bit checks against the reference are in tests/kernels."""

from __future__ import annotations

import math

import pytest
import torch
from support.float64 import sumsq_rel_bound
from support.grad_accumulate import (
    DTYPES,
    PAIRS,
    SIZES,
    assert_nearest_even,
    assert_neighbour,
    fp32_sum,
    make_case,
    sr_mean_bound,
    sr_model,
    sr_offsets,
    sumsq_model,
)

from lomo_kernels import ops

PAIR_IDS = [f"b{b}-g{g}" for b, g in PAIRS]
INV_SCALE = 2.0**-3


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


@pytest.mark.parametrize("first", [False, True], ids=["add", "first"])
@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("bdt,gdt", PAIRS, ids=PAIR_IDS)
def test_nearest_even_of_the_fp32_sum(backend, bdt, gdt, n, first):
    buffer, grad = make_case(n, DTYPES[bdt], DTYPES[gdt], seed=n)
    x = fp32_sum(buffer, grad, first)
    if first:
        buffer.fill_(float("nan"))  # not read
    sumsq, found = torch.tensor([0.75]), torch.zeros(1)
    ops.grad_accumulate_(
        buffer, grad, first=first, inv_scale=INV_SCALE, sumsq=sumsq, found_inf=found,
        backend=backend,
    )  # fmt: skip
    assert_nearest_even(buffer, x)
    assert found.item() == 0.0
    # Of the stored values (not of the fp32 sums), within the backend's summation bound.
    expected = sumsq_model(buffer, INV_SCALE, 0.75)
    assert math.isclose(sumsq.item(), expected, rel_tol=sumsq_rel_bound(backend, n))


@pytest.mark.parametrize("bdt,gdt", PAIRS, ids=PAIR_IDS)
def test_options_absent_store_the_same(backend, bdt, gdt):
    # Without sumsq and found_inf nothing is measured; the stored bits do not change.
    buffer, grad = make_case(4097, DTYPES[bdt], DTYPES[gdt], seed=3)
    measured, plain = buffer.clone(), buffer.clone()
    ops.grad_accumulate_(measured, grad, sumsq=torch.zeros(1), found_inf=torch.zeros(1),
                         backend=backend)  # fmt: skip
    ops.grad_accumulate_(plain, grad, backend=backend)
    assert torch.equal(_bits(measured), _bits(plain))
    assert_nearest_even(plain, fp32_sum(buffer, grad, False))


@pytest.mark.parametrize("inv_scale", [None, 0.5, "tensor"])
def test_inv_scale_forms(backend, inv_scale):
    buffer, grad = make_case(4097, torch.bfloat16, torch.float32, seed=5)
    value = 1.0 if inv_scale is None else 0.25 if inv_scale == "tensor" else inv_scale
    given = torch.tensor([0.25]) if inv_scale == "tensor" else inv_scale
    sumsq = torch.zeros(1)
    ops.grad_accumulate_(buffer, grad, inv_scale=given, sumsq=sumsq, backend=backend)
    expected = sumsq_model(buffer, value, 0.0)
    assert math.isclose(sumsq.item(), expected, rel_tol=sumsq_rel_bound(backend, 4097))


@pytest.mark.parametrize("first", [False, True], ids=["add", "first"])
@pytest.mark.parametrize("bdt", ["bf16", "fp16"])
def test_stochastic_rounding_neighbours_same_bits_every_backend(backend, bdt, first):
    # Every backend, the torch reference included, stores the bits of the float64 model
    # (sr_model: the documented stream and rule, computed without the package).
    seed, step = 2**62 + 11, 2**33 + 5
    for gdt in ("fp32", bdt):
        for n in (7, 4097, 278011):
            buffer, grad = make_case(n, DTYPES[bdt], DTYPES[gdt], seed=n + 1)
            x = fp32_sum(buffer, grad, first)
            got, found = buffer.clone(), torch.zeros(1)
            ops.grad_accumulate_(got, grad, first=first, found_inf=found,
                                 stochastic_rounding=True, seed=seed,
                                 seed_step=torch.tensor([step]), backend=backend)  # fmt: skip
            want = sr_model(x, DTYPES[bdt], seed, step).to(DTYPES[bdt])
            assert torch.equal(_bits(got), _bits(want))
            assert found.item() == 0.0
            assert_neighbour(got, x)


@pytest.mark.parametrize("bdt,gdt", [p for p in PAIRS if p[0] != "fp32"], ids=PAIR_IDS[1:])
def test_stochastic_rounding_is_unbiased(backend, bdt, gdt):
    # Many seeds over one buffer: the mean offset from the fp32 sum, in spacings, is 0 within
    # sr_mean_bound; rounding to nearest is far off it (a detectably biased rule fails too).
    n, seeds = 4097, 48
    buffer, grad = make_case(n, DTYPES[bdt], DTYPES[gdt], seed=11)
    x = fp32_sum(buffer, grad, False)
    offsets = []
    for seed in range(seeds):
        out = buffer.clone()
        ops.grad_accumulate_(out, grad, stochastic_rounding=True, seed=seed, backend=backend)
        assert_neighbour(out, x)
        offsets.append(sr_offsets(out, x))
    offsets = torch.stack(offsets)
    assert abs(offsets.mean().item()) <= sr_mean_bound(offsets.numel())
    # Per element over the seeds: up as often as its fraction says, within 6 standard
    # deviations (sqrt(f(1 - f) / seeds) <= 0.5 / sqrt(seeds)) plus the quantisation bias.
    per_element = offsets.mean(dim=0)
    assert per_element.abs().max().item() <= sr_mean_bound(seeds)
    # The draws differ from seed to seed.
    assert (offsets[0] != offsets[1]).float().mean().item() > 0.2


@pytest.mark.parametrize("bdt,gdt", PAIRS, ids=PAIR_IDS)
def test_non_finite_gradients_raise_found_inf(backend, bdt, gdt):
    n = 4097
    for index, value in ((0, float("inf")), (2049, float("nan")), (n - 1, float("-inf"))):
        buffer, grad = make_case(n, DTYPES[bdt], DTYPES[gdt], seed=index)
        grad[index] = value
        x = fp32_sum(buffer, grad, False)
        sumsq, found = torch.zeros(1), torch.zeros(1)
        ops.grad_accumulate_(buffer, grad, sumsq=sumsq, found_inf=found, backend=backend)
        assert found.item() == 1.0
        assert not math.isfinite(sumsq.item())
        # The non-finite sum is stored as it is (not skipped), the rest as ever.
        assert math.isnan(value) == bool(buffer[index].isnan()) and not buffer[index].isfinite()
        finite = x.isfinite()
        assert_nearest_even(buffer[finite], x[finite])
        # Without sumsq the flag alone.
        buffer, grad = make_case(n, DTYPES[bdt], DTYPES[gdt], seed=index)
        grad[index] = value
        found = torch.zeros(1)
        ops.grad_accumulate_(buffer, grad, found_inf=found, backend=backend)
        assert found.item() == 1.0


# The Triton interpreter's numpy warns on the overflows the case is made of.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_found_inf_measures_the_stored_values(backend):
    # fp16: 60000 + 10000 is finite in fp32 but stored as inf; fp32: a finite stored value
    # that inv_scale takes past fp32's range. Both flagged; a finite clean case is not.
    buffer = torch.full((37,), 60000.0, dtype=torch.float16)
    grad = torch.zeros(37)
    grad[20] = 10000.0
    found = torch.zeros(1)
    ops.grad_accumulate_(buffer, grad, found_inf=found, backend=backend)
    assert found.item() == 1.0 and buffer[20].isinf()
    big = torch.full((37,), 3e38)
    found = torch.zeros(1)
    ops.grad_accumulate_(big, torch.zeros(37), inv_scale=4.0, found_inf=found, backend=backend)
    assert found.item() == 1.0 and big.isfinite().all()
    found = torch.full((1,), 0.0)
    ops.grad_accumulate_(torch.ones(37), torch.ones(37), inv_scale=4.0, found_inf=found,
                         backend=backend)  # fmt: skip
    assert found.item() == 0.0


def test_found_inf_is_never_reset(backend):
    buffer, grad = make_case(100, torch.bfloat16, torch.bfloat16, seed=1)
    found = torch.ones(1)
    ops.grad_accumulate_(buffer, grad, found_inf=found, backend=backend)
    assert found.item() == 1.0


def test_accumulating_micro_batches(backend):
    # k passes, the first not reading the (uninitialised) buffer, each the nearest of its sum.
    n = 4097
    buffer = torch.empty(n, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    for k in range(4):
        grad = torch.randn(n, generator=gen).to(torch.bfloat16)
        x = fp32_sum(buffer, grad, first=k == 0)
        ops.grad_accumulate_(buffer, grad, first=k == 0, backend=backend)
        assert_nearest_even(buffer, x)


def test_empty_tensors(backend):
    for dtype in DTYPES.values():
        sumsq, found = torch.tensor([2.0]), torch.zeros(1)
        ops.grad_accumulate_(torch.empty(0, dtype=dtype), torch.empty(0), sumsq=sumsq,
                             found_inf=found, stochastic_rounding=dtype != torch.float32,
                             backend=backend)  # fmt: skip
        assert sumsq.item() == 2.0 and found.item() == 0.0


def test_stochastic_rounding_refused_for_fp32():
    with pytest.raises(ValueError, match="stochastic_rounding"):
        ops.grad_accumulate_(torch.zeros(4), torch.zeros(4), stochastic_rounding=True)


def test_shape_mismatch_refused():
    with pytest.raises(ValueError, match="shape"):
        ops.grad_accumulate_(torch.zeros(4, 6), torch.zeros(6, 4))
