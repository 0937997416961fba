"""The 8-bit blockwise accumulation buffer's ops on every backend (torch reference, C++,
Triton through its interpreter) against an independent float64 model of the format
(support/int8_model.py): `grad_accumulate_int8_` stores the model's power-of-two block scales
and the nearest-even codes, or stochastically one of the two neighbours, unbiased, drawn at the
whole parameter's flat index; `lomo_update_int8_` is `fused_lomo_update_` of the dequantised
gradient, bit for bit; `int8_dequantize_` is code * scale, exact in fp32 and bf16. Comparisons
with the reference itself belong to the backends' tests in tests/kernels."""

from __future__ import annotations

import math

import pytest
import torch
from support.float64 import sumsq_rel_bound
from support.grad_accumulate import assert_nearest_even, sumsq_model
from support.int8_model import (
    BLOCK,
    assert_nearest,
    assert_neighbours,
    block_count,
    block_index,
    dequantised,
    fp32_new,
    quantise,
    random_codes,
    random_scales,
    sr_mean_bound,
    sr_offsets,
    stored_values,
)
from support.lomo_bitwise import assert_same_bits

from lomo_kernels import ops

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SMALL_SIZES = [1, 7, 255, 256, 257, 4097]
LARGE = 278011
# Partial first blocks (1, 255, 300, 2**32 + 5: lead 5) and aligned ones (0, 256); the last
# is past 32 bits, so the block geometry and the rounding index need 64-bit arithmetic.
OFFSETS = [0, 1, 255, 256, 300, 2**32 + 5]
INV_SCALE = 2.0**-3
SUMSQ_START = 0.75
SEED = 2**62 + 11
STEP = 2**33 + 5  # its low 32 bits are the step's part of the key
INF, NAN = float("inf"), float("nan")


def offset_id(offset: int) -> str:
    return "o2^32+5" if offset == 2**32 + 5 else f"o{offset}"


# Every size at every offset, the gradient dtype turning with them (each size and each offset
# meets all three), so a backend's cost stays in seconds.
SIZE_OFFSET_DTYPE = [
    (n, offset, list(DTYPES)[(i + j) % 3])
    for i, n in enumerate(SMALL_SIZES)
    for j, offset in enumerate(OFFSETS)
]
SIZE_OFFSET_DTYPE_IDS = [f"n{n}-{offset_id(o)}-{g}" for n, o, g in SIZE_OFFSET_DTYPE]


def make_grad(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Gradients whose magnitude changes every 64 elements (so a block mixes binades and its
    small values round to few codes), with zeros of both signs, and small enough in fp16."""
    gen = torch.Generator().manual_seed(seed)
    span = (-14, 8) if dtype == torch.float16 else (-30, 30)
    exponents = torch.randint(span[0], span[1] + 1, ((n + 63) // 64,), generator=gen)
    magnitude = torch.pow(2.0, exponents.double()).repeat_interleave(64)[:n]
    grad = (torch.randn(n, generator=gen, dtype=torch.float64) * magnitude).to(dtype)
    for i, value in enumerate([0.0, -0.0][: max(0, n - 5)]):
        grad[5 + i] = value
    return grad


def make_buffer(n: int, offset: int, seed: int, low: int = -24, high: int = 8):
    """(codes, scales): random codes, random power-of-two scales 2**low .. 2**high."""
    gen = torch.Generator().manual_seed(seed + 7)
    return random_codes(n, gen), random_scales(block_count(offset, n), gen, low, high)


def garbage_buffer(n: int, offset: int, seed: int):
    """(codes, scales) of arbitrary bits (-128, nan and inf scales among them): first=True
    must not read them."""
    gen = torch.Generator().manual_seed(seed + 13)
    codes = torch.randint(-128, 128, (n,), generator=gen, dtype=torch.int8)
    count = block_count(offset, n)
    bits = torch.randint(-(2**31), 2**31, (count,), generator=gen, dtype=torch.int64)
    scales = bits.to(torch.int32).view(torch.float32).clone()
    scales[::3] = NAN
    scales[1::3] = INF
    return codes, scales


def accumulate(backend, codes, scales, grad, offset, first, inv_scale=INV_SCALE, **kwargs):
    """`grad_accumulate_int8_` in place with sumsq (from SUMSQ_START) and found_inf:
    (sumsq, found_inf) as floats."""
    sumsq, found = torch.tensor([SUMSQ_START]), torch.zeros(1)
    ops.grad_accumulate_int8_(
        codes, scales, grad, offset=offset, first=first, inv_scale=inv_scale, sumsq=sumsq,
        found_inf=found, backend=backend, **kwargs,
    )  # fmt: skip
    return sumsq.item(), found.item()


def case(n: int, offset: int, gdt: str, first: bool, seed: int):
    """(codes, scales, grad, model): a buffer (garbage when `first`) and its model's store."""
    grad = make_grad(n, DTYPES[gdt], seed)
    codes, scales = make_buffer(n, offset, seed)
    model = quantise(fp32_new(grad, codes, scales, offset, first), offset)
    if first:
        codes, scales = garbage_buffer(n, offset, seed)
    return codes, scales, grad, model


def assert_sumsq(backend, sumsq, codes, scales, offset, inv_scale=INV_SCALE) -> None:
    """sumsq: SUMSQ_START + the model's sum of (stored value * inv_scale) ** 2."""
    expected = sumsq_model(stored_values(codes, scales, offset), inv_scale, SUMSQ_START)
    assert math.isclose(sumsq, expected, rel_tol=sumsq_rel_bound(backend, codes.numel()))


# -- grad_accumulate_int8_: round to nearest --------------------------------------------


@pytest.mark.parametrize("first", [False, True], ids=["add", "first"])
@pytest.mark.parametrize("n,offset,gdt", SIZE_OFFSET_DTYPE, ids=SIZE_OFFSET_DTYPE_IDS)
def test_nearest_scales_and_codes(backend, n, offset, gdt, first):
    codes, scales, grad, model = case(n, offset, gdt, first, seed=n + offset % 1000)
    sumsq, found = accumulate(backend, codes, scales, grad, offset, first)
    assert_nearest(codes, scales, model)
    assert found == 0.0
    assert_sumsq(backend, sumsq, codes, scales, offset)


@pytest.mark.parametrize("first", [False, True], ids=["add", "first"])
@pytest.mark.parametrize("gdt", DTYPES)
def test_nearest_every_grad_dtype(backend, gdt, first):
    codes, scales, grad, model = case(4097, 300, gdt, first, seed=2)
    sumsq, found = accumulate(backend, codes, scales, grad, 300, first)
    assert_nearest(codes, scales, model)
    assert found == 0.0
    assert_sumsq(backend, sumsq, codes, scales, 300)


@pytest.mark.parametrize("gdt", DTYPES)
def test_nearest_large(backend, gdt):
    offset = 2**32 + 5
    codes, scales, grad, model = case(LARGE, offset, gdt, first=False, seed=3)
    sumsq, found = accumulate(backend, codes, scales, grad, offset, False)
    assert_nearest(codes, scales, model)
    assert found == 0.0
    assert_sumsq(backend, sumsq, codes, scales, offset)


@pytest.mark.parametrize("first", [False, True], ids=["add", "first"])
def test_ties_round_to_even(backend, first):
    # One block of scale 2**-3 (its largest magnitude 127 * 2**-3) holding every half-code
    # k + 1/2, k in [-127, 126]: each a tie, rounded to the even code.
    halves = torch.arange(-127, 127, dtype=torch.float64) + 0.5
    ratio = torch.cat([torch.tensor([127.0]), halves, torch.tensor([-0.0])])
    grad = (ratio * 2.0**-3).float()
    codes, scales = torch.zeros(256, dtype=torch.int8), torch.zeros(1)
    if not first:  # the same sums from an old buffer of scale 2**-2 and the remainder
        old = torch.trunc(ratio / 2).to(torch.int8)
        codes, scales = old.clone(), torch.tensor([2.0**-2])
        grad = grad - old.float() * 2.0**-2
    model = quantise(fp32_new(grad, codes, scales, 0, first), 0)
    assert bool(((model.ratio - model.below) == 0.5).sum() == 254)
    accumulate(backend, codes, scales, grad, 0, first)
    assert scales.item() == 2.0**-3
    assert_nearest(codes, scales, model)
    assert bool((codes[1:-1].double().remainder(2) == 0).all())


def test_scale_rule_edges(backend):
    # One block per largest magnitude: exactly 127 * 2**e keeps 2**e, the next fp32 above
    # takes 2**(e + 1); 1 and 2 (code 64); 127/64 (code 127) and the next fp32 above (the
    # rule's other case: code 64); fp32's subnormals and smallest normals share the floor
    # scale 2**-126; large values near fp32's range.
    tiny = 2.0**-149
    largest = [
        127 * 2.0**-3,
        float(torch.tensor(127 * 2.0**-3).nextafter(torch.tensor(INF)).float()),
        1.0,
        2.0,
        127 / 64,
        float(torch.tensor(127 / 64, dtype=torch.float32).nextafter(torch.tensor(2.0))),
        tiny,
        2.0**-126,
        127 * 2.0**-126,
        128 * 2.0**-126,
        127 * 2.0**121,
        -3.0e38,
    ]
    grad = torch.zeros(BLOCK * len(largest))
    gen = torch.Generator().manual_seed(0)
    for b, value in enumerate(largest):
        block = grad[b * BLOCK : (b + 1) * BLOCK]
        block.copy_(torch.rand(BLOCK, generator=gen) * 2 - 1).mul_(abs(value))
        block[BLOCK // 2] = value
    model = quantise(grad.double(), 0)
    codes = torch.zeros(grad.numel(), dtype=torch.int8)
    scales = torch.zeros(len(largest))
    _, found = accumulate(backend, codes, scales, grad, 0, True, inv_scale=1.0)
    assert model.scales[:4].tolist() == [2.0**-3, 2.0**-2, 2.0**-6, 2.0**-5]
    assert model.scales[6:10].tolist() == [2.0**-126] * 3 + [2.0**-125]
    assert_nearest(codes, scales, model)
    assert found == 0.0


# -- grad_accumulate_int8_: stochastic rounding ------------------------------------------


@pytest.mark.parametrize("n,offset,gdt", SIZE_OFFSET_DTYPE, ids=SIZE_OFFSET_DTYPE_IDS)
def test_stochastic_codes_are_neighbours(backend, n, offset, gdt):
    first = gdt == "bf16"  # turning with the dtype: each size and offset both ways
    codes, scales, grad, model = case(n, offset, gdt, first, seed=n + 1)
    step = torch.tensor([STEP], dtype=torch.int64)
    kwargs = dict(stochastic_rounding=True, seed=SEED, seed_step=step)
    again_codes, again_scales = codes.clone(), scales.clone()
    sumsq, found = accumulate(backend, codes, scales, grad, offset, first, **kwargs)
    assert_neighbours(codes, scales, model)
    assert found == 0.0
    assert_sumsq(backend, sumsq, codes, scales, offset)
    # Reproducible from the seed and the step.
    accumulate(backend, again_codes, again_scales, grad, offset, first, **kwargs)
    assert torch.equal(again_codes, codes) and torch.equal(again_scales, scales)


def test_stochastic_large(backend):
    codes, scales, grad, model = case(LARGE, 2**32 + 5, "bf16", first=False, seed=4)
    kwargs = dict(stochastic_rounding=True, seed=SEED, seed_step=torch.tensor([STEP]))
    sumsq, found = accumulate(backend, codes, scales, grad, 2**32 + 5, False, **kwargs)
    assert_neighbours(codes, scales, model)
    assert found == 0.0
    assert_sumsq(backend, sumsq, codes, scales, 2**32 + 5)


def fractional_grad(n: int, offset: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad, fraction): every block's first element 127 * 2**e (its scale 2**e, e per
    block), the others (k + f) * 2**e with f one of 1/4, 1/2, 3/4 or a random 16-bit
    fraction (`fraction` holds f; -1 on the blocks' first elements)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = block_index(offset, n)
    e = torch.randint(-20, 20, (block_count(offset, n),), generator=gen).double()[blocks]
    k = torch.randint(-126, 126, (n,), generator=gen).double()
    fixed = torch.tensor([0.25, 0.5, 0.75, -1.0], dtype=torch.float64)
    fraction = fixed[torch.randint(0, 4, (n,), generator=gen)]
    random16 = torch.randint(1, 2**16, (n,), generator=gen).double() * 2.0**-16
    fraction = torch.where(fraction < 0, random16, fraction)
    ratio = k + fraction
    lead = torch.ones(n, dtype=torch.bool)
    lead[1:] = blocks[1:] != blocks[:-1]
    ratio = torch.where(lead, 127.0, ratio)
    fraction = torch.where(lead, -1.0, fraction)
    return (ratio * torch.pow(2.0, e)).float(), fraction


def test_stochastic_rounding_is_unbiased(backend):
    # Over steps and elements: the mean offset code - value / scale is 0 within
    # sr_mean_bound, for each fraction alone (nearest would be off by 1/4 at 1/4 and 3/4);
    # each step draws differently.
    n, offset, steps = 4097, 300, 8
    grad, fraction = fractional_grad(n, offset, seed=1)
    model = quantise(grad.double(), offset)
    assert torch.equal(model.ratio - model.below, torch.where(fraction < 0, 0.0, fraction))
    offsets = []
    for step in range(steps):
        codes = torch.empty(n, dtype=torch.int8)
        scales = torch.empty(block_count(offset, n))
        kwargs = dict(stochastic_rounding=True, seed=SEED, seed_step=torch.tensor([step]))
        accumulate(backend, codes, scales, grad, offset, True, **kwargs)
        assert_neighbours(codes, scales, model)
        offsets.append(sr_offsets(codes, model))
    offsets = torch.stack(offsets)
    for f in (0.25, 0.5, 0.75):
        group = offsets[:, fraction == f]
        assert abs(group.mean().item()) <= sr_mean_bound(group.numel()), f
    spread = offsets[:, fraction > 0]
    assert abs(spread.mean().item()) <= sr_mean_bound(spread.numel())
    assert (offsets[0] != offsets[1]).double().mean().item() > 0.2


@pytest.mark.parametrize("whole", [0.0, -2.0, 40.0, 100.0, -101.0])
@pytest.mark.parametrize("cell", [0, 777, 65528])
def test_stochastic_rule_rounds_up_with_the_fractions_probability(whole, cell):
    # The rule itself, over all 2**16 random values r at once, for x = n + f with n = whole
    # and whole + 1 and f every multiple of `step` in 8 cells of 2**-16 from `cell` (step:
    # 2**-20, or fp32's spacing at |x| >= 32, where x + u is exact and can fall half-way
    # between codes): the mean code minus x is within 2**-17 of 0 (f's rounding to the
    # 2**-16 grid) for each x and exactly 0 over them, the half-way ties going to the even
    # code, up from one n and down from the next. floor(x + r / 2**16) leans toward -inf by
    # 2**-18 on average, and ties always rounded up toward +inf at |x| >= 64: both fail.
    step = 2.0**-20 if abs(whole) < 32 else 2.0**-18 if abs(whole) < 64 else 2.0**-17
    per_cell = round(2.0**-16 / step)
    r = torch.arange(2**16, dtype=torch.int64)
    fractions = cell * 2.0**-16 + torch.arange(8 * per_cell, dtype=torch.float64) * step
    exact = torch.cat([whole + fractions, whole + 1 + fractions])
    x = exact.float()
    assert torch.equal(x.double(), exact)  # every x exact in fp32
    codes = ops.lomo.reference.int8_stochastic_codes(x[:, None], r[None, :])
    bias = codes.double().mean(dim=1) - exact
    assert bias.abs().max().item() <= 2.0**-17
    assert bias.mean().item() == 0.0


@pytest.mark.parametrize("first", [False, True], ids=["add", "first"])
def test_stochastic_aligned_slice_stores_the_whole_buffers_blocks(backend, first):
    # A slice from a multiple of 256 to a multiple of 256 or the parameter's end holds whole
    # blocks of the parameter: the same scales and, from the same seed and step, the same
    # codes as the whole buffer at its elements.
    n = 1300
    grad = make_grad(n, torch.bfloat16, seed=5)
    whole_codes, whole_scales = make_buffer(n, 0, seed=5)
    kwargs = dict(stochastic_rounding=True, seed=SEED, seed_step=torch.tensor([STEP]))
    old_codes, old_scales = whole_codes.clone(), whole_scales.clone()
    accumulate(backend, whole_codes, whole_scales, grad, 0, first, **kwargs)
    for start, stop in ((256, n), (512, 1024), (0, 768), (1024, n), (1280, n)):
        lo, hi = start // BLOCK, start // BLOCK + block_count(start, stop - start)
        codes, scales = old_codes[start:stop].clone(), old_scales[lo:hi].clone()
        accumulate(backend, codes, scales, grad[start:stop], start, first, **kwargs)
        assert torch.equal(codes, whole_codes[start:stop]), (start, stop)
        assert torch.equal(scales, whole_scales[lo:hi]), (start, stop)


def test_stochastic_rounding_reads_the_whole_64_bit_index(backend):
    # Offsets 2**32 + 5 and 5 cut the same blocks, but the rounding bits of flat index
    # offset + j differ: a backend dropping the index's high half would store the same codes.
    grad, _ = fractional_grad(4097, 5, seed=2)
    stored = []
    for offset in (5, 2**32 + 5):
        codes, scales = torch.empty(4097, dtype=torch.int8), torch.empty(block_count(5, 4097))
        accumulate(backend, codes, scales, grad, offset, True, stochastic_rounding=True, seed=3)
        assert_neighbours(codes, scales, quantise(grad.double(), offset))
        stored.append((codes, scales))
    assert torch.equal(stored[0][1], stored[1][1])
    assert (stored[0][0] != stored[1][0]).double().mean().item() > 0.2


# -- grad_accumulate_int8_: zero and non-finite blocks -----------------------------------


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("first", [False, True], ids=["add", "first"])
def test_all_zero_blocks_store_scale_zero(backend, first, stochastic):
    # At offset 100: blocks [0, 156), [156, 412), [412, 668), [668, 924), [924, 1000). The
    # second and the last are zeros of both signs; when adding, the third sums to exact zeros.
    n, offset = 1000, 100
    grad = make_grad(n, torch.float32, seed=6)
    grad[156:412] = 0.0
    grad[156:412:2] = -0.0
    grad[924:] = -0.0
    codes, scales = make_buffer(n, offset, seed=6)
    codes[156:412] = 0
    codes[924:] = 0
    if not first:
        grad[412:668] = -dequantised(codes, scales, offset)[412:668].float()
    model = quantise(fp32_new(grad, codes, scales, offset, first), offset)
    zero_blocks = [1, 4] if first else [1, 2, 4]
    assert [b for b in range(5) if model.scales[b] == 0] == zero_blocks
    kwargs = dict(stochastic_rounding=stochastic, seed=SEED)
    sumsq, found = accumulate(backend, codes, scales, grad, offset, first, **kwargs)
    for b in zero_blocks:
        assert scales[b].item() == 0.0
        assert not bool(codes[block_index(offset, n) == b].any())
    (assert_neighbours if stochastic else assert_nearest)(codes, scales, model)
    assert found == 0.0
    assert_sumsq(backend, sumsq, codes, scales, offset)


WHERE = {"first": 0, "middle": 500, "last": 999}  # blocks 0, 2, 4 at offset 300


@pytest.mark.parametrize("value", [INF, -INF, NAN], ids=str)
@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("gdt", DTYPES)
def test_non_finite_block_stores_nan_scale(backend, gdt, where, value):
    n, offset = 1000, 300
    index = WHERE[where]
    bad_block = int(block_index(offset, n)[index])
    for first in (False, True):
        codes, scales, grad, model = case(n, offset, gdt, first, seed=index)
        grad[index] = value
        model = quantise(fp32_new(grad, codes, scales, offset, first), offset)
        assert model.scales.isnan().tolist() == [b == bad_block for b in range(5)]
        sumsq, found = accumulate(backend, codes, scales, grad, offset, first)
        assert math.isnan(scales[bad_block].item())
        assert not bool(codes[block_index(offset, n) == bad_block].any())
        assert_nearest(codes, scales, model)  # the other blocks untouched by it
        assert found == 1.0 and not math.isfinite(sumsq)
    # found_inf alone, without sumsq.
    codes, scales, grad, _ = case(n, offset, gdt, False, seed=index)
    grad[index] = value
    found = torch.zeros(1)
    ops.grad_accumulate_int8_(codes, scales, grad, offset=offset, found_inf=found,
                              stochastic_rounding=True, backend=backend)  # fmt: skip
    assert found.item() == 1.0 and math.isnan(scales[bad_block].item())


def test_nan_scale_persists_until_first(backend):
    # A nan block of the old buffer (an earlier overflow) stays nan when added to; first=True
    # starts afresh.
    n, offset = 600, 0
    codes, scales = make_buffer(n, offset, seed=8)
    scales[1] = NAN
    codes[256:512] = 0
    grad = make_grad(n, torch.float32, seed=8)
    model = quantise(fp32_new(grad, codes, scales, offset, False), offset)
    _, found = accumulate(backend, codes, scales, grad, offset, False)
    assert_nearest(codes, scales, model)
    assert math.isnan(scales[1].item()) and found == 1.0
    model = quantise(fp32_new(grad, codes, scales, offset, True), offset)
    _, found = accumulate(backend, codes, scales, grad, offset, True)
    assert_nearest(codes, scales, model)
    assert found == 0.0


def test_found_inf_measures_the_stored_values_times_inv_scale(backend):
    # 3e38 is stored finite (code 113, scale 2**121, 3.004e38); times inv_scale 1.2 or 4 it
    # overflows fp32 (3.403e38), times 1.1 not, though 127 * 2**121 * 1.1 would: the flag
    # alone (no sumsq) reads the codes there, and must agree with the squares.
    grad = torch.full((37,), 1.0)
    grad[20] = 3.0e38
    for inv_scale, flagged in ((1.0, 0.0), (1.1, 0.0), (1.2, 1.0), (4.0, 1.0)):
        codes, scales = torch.empty(37, dtype=torch.int8), torch.empty(1)
        sumsq, found = accumulate(backend, codes, scales, grad, 0, True, inv_scale=inv_scale)
        assert scales.item() == 2.0**121 and codes[20].item() == 113
        assert found == flagged
        alone = torch.zeros(1)
        ops.grad_accumulate_int8_(codes, scales, grad, offset=0, first=True, inv_scale=inv_scale,
                                  found_inf=alone, backend=backend)  # fmt: skip
        assert alone.item() == flagged


def test_options_absent_store_the_same(backend):
    codes, scales, grad, model = case(4097, 300, "bf16", False, seed=9)
    plain_codes, plain_scales = codes.clone(), scales.clone()
    accumulate(backend, codes, scales, grad, 300, False)
    ops.grad_accumulate_int8_(plain_codes, plain_scales, grad, offset=300, backend=backend)
    assert torch.equal(plain_codes, codes) and torch.equal(plain_scales, scales)
    assert_nearest(plain_codes, plain_scales, model)


def test_empty_buffers(backend):
    sumsq, found = torch.tensor([2.0]), torch.zeros(1)
    for offset in (0, 300):
        ops.grad_accumulate_int8_(
            torch.empty(0, dtype=torch.int8), torch.empty(0), torch.empty(0), offset=offset,
            sumsq=sumsq, found_inf=found, stochastic_rounding=True, backend=backend,
        )  # fmt: skip
        ops.lomo_update_int8_(torch.empty(0, dtype=torch.bfloat16),
                              torch.empty(0, dtype=torch.int8), torch.empty(0), offset=offset,
                              lr=0.1, backend=backend)  # fmt: skip
        ops.int8_dequantize_(torch.empty(0), torch.empty(0, dtype=torch.int8), torch.empty(0),
                             offset=offset, backend=backend)  # fmt: skip
    assert sumsq.item() == 2.0 and found.item() == 0.0


# -- refusals: raised before anything is written -----------------------------------------


def refusal_cases():
    """(name, codes, scales, offset, n, exception, message pattern) of buffers refused."""
    n, offset = 700, 300  # blocks_of(300, 700) == 3
    good_codes, good_scales = torch.zeros(n, dtype=torch.int8), torch.zeros(3)
    return [
        ("scales short", good_codes, torch.zeros(2), offset, n, ValueError, r"\b3\b"),
        ("scales long", good_codes, torch.zeros(4), offset, n, ValueError, r"\b3\b"),
        ("uint8 codes", good_codes.to(torch.uint8), good_scales, offset, n, TypeError, "int8"),
        ("fp32 codes", good_codes.float(), good_scales, offset, n, TypeError, "int8"),
        ("fp64 scales", good_codes, good_scales.double(), offset, n, TypeError, "float32 scales"),
        ("bf16 scales", good_codes, good_scales.bfloat16(), offset, n, TypeError, "float32 scales"),
        # Another device than the data's (meta: no device of its own needed here).
        (
            "codes elsewhere",
            good_codes.to("meta"),
            good_scales,
            offset,
            n,
            ValueError,
            "codes is on",
        ),
        (
            "scales elsewhere",
            good_codes,
            good_scales.to("meta"),
            offset,
            n,
            ValueError,
            "scales is",
        ),
        ("negative offset", good_codes, good_scales, -1, n, ValueError, "offset"),
        ("codes short", good_codes[:-1], good_scales, offset, n, ValueError, "699"),
    ]


@pytest.mark.parametrize("op", ["accumulate", "update", "dequantize"])
@pytest.mark.parametrize("which", range(len(refusal_cases())))
def test_refusals_write_nothing(op, which):
    name, codes, scales, offset, n, error, pattern = refusal_cases()[which]
    codes = codes.clone().fill_(5)
    scales = scales.clone().fill_(0.5)
    data = torch.full((n,), 3.0)
    sumsq, found = torch.tensor([1.5]), torch.zeros(1)
    kept = [t.clone() for t in (codes, scales, data, sumsq, found)]
    with pytest.raises(error, match=pattern):
        if op == "accumulate":
            ops.grad_accumulate_int8_(codes, scales, data, offset=offset, first=True,
                                      sumsq=sumsq, found_inf=found)  # fmt: skip
        elif op == "update":
            ops.lomo_update_int8_(data, codes, scales, offset=offset, lr=0.1, found_inf=found)
        else:
            ops.int8_dequantize_(data, codes, scales, offset=offset)
    for before, after in zip(kept, (codes, scales, data, sumsq, found), strict=True):
        assert before.is_meta or torch.equal(before, after), name  # a meta tensor holds none


# -- lomo_update_int8_ -------------------------------------------------------------------

LR = 0.05
OPTIONS = {
    "plain": {},
    "inv_scale": {"inv_scale": 2.0**-10},
    "clip_value": {"clip_value": 0.5},
    "clip_coef": {"clip_coef": 0.37},
    "weight_decay": {"weight_decay": 0.1},
    "all": {"inv_scale": 2.0**-10, "clip_value": 0.5, "clip_coef": 0.37, "weight_decay": 0.1},
}


def update_case(n: int, offset: int, pdt: str, seed: int, nan_block: bool = False):
    """(param, codes, scales, grad): a buffer (a zero block, a nan one when asked) and the
    model's dequantised gradient in fp32."""
    gen = torch.Generator().manual_seed(seed)
    param = torch.randn(n, generator=gen).to(DTYPES[pdt])
    codes, scales = make_buffer(n, offset, seed, low=-8, high=4)
    if scales.numel() > 2:
        scales[1] = 0.0
        codes[block_index(offset, n) == 1] = 0
    if nan_block:
        scales[-1] = NAN
        codes[block_index(offset, n) == scales.numel() - 1] = 0
    return param, codes, scales, dequantised(codes, scales, offset).float()


def both_updates(backend, param, codes, scales, grad, offset, **kwargs):
    """(int8 update, fused update of `grad`) on copies of `param`, with found_inf each:
    ((params), (flags))."""
    got, want = param.clone(), param.clone()
    f_got, f_want = torch.zeros(1), torch.zeros(1)
    ops.lomo_update_int8_(got, codes, scales, offset=offset, lr=LR, found_inf=f_got,
                          backend=backend, **kwargs)  # fmt: skip
    ops.fused_lomo_update_(want, grad, lr=LR, found_inf=f_want, backend=backend, **kwargs)
    return (got, want), (f_got.item(), f_want.item())


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("pdt", DTYPES)
def test_update_is_the_fused_update_of_the_dequantised_gradient(backend, pdt, option):
    param, codes, scales, grad = update_case(4097, 300, pdt, seed=1)
    (got, want), flags = both_updates(backend, param, codes, scales, grad, 300, **OPTIONS[option])
    assert_same_bits(got, want)
    assert flags == (0.0, 0.0)
    assert not torch.equal(got, param)


@pytest.mark.parametrize("offset", [0, 1, 255, 2**32 + 5], ids=offset_id)
@pytest.mark.parametrize("n", [1, 7, 256, 257], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("pdt", DTYPES)
def test_update_sizes_and_offsets(backend, pdt, n, offset):
    param, codes, scales, grad = update_case(n, offset, pdt, seed=n)
    (got, want), flags = both_updates(backend, param, codes, scales, grad, offset,
                                      **OPTIONS["all"])  # fmt: skip
    assert_same_bits(got, want)
    assert flags == (0.0, 0.0)


def test_update_large_with_tensor_scalars(backend):
    param, codes, scales, grad = update_case(LARGE, 2**32 + 5, "bf16", seed=2)
    options = {**OPTIONS["all"], "inv_scale": torch.tensor([2.0**-10]),
               "clip_coef": torch.tensor([0.37])}  # fmt: skip
    got, want = param.clone(), param.clone()
    ops.lomo_update_int8_(got, codes, scales, offset=2**32 + 5, lr=torch.tensor([LR]),
                          backend=backend, **options)  # fmt: skip
    ops.fused_lomo_update_(want, grad, lr=torch.tensor([LR]), backend=backend, **options)
    assert_same_bits(got, want)


@pytest.mark.parametrize("pdt", DTYPES)
def test_update_nan_scale_keeps_its_block_and_raises_found_inf(backend, pdt):
    n, offset = 1000, 300
    param, codes, scales, grad = update_case(n, offset, pdt, seed=3, nan_block=True)
    (got, want), flags = both_updates(backend, param, codes, scales, grad, offset,
                                      **OPTIONS["all"])  # fmt: skip
    assert_same_bits(got, want)
    assert flags == (1.0, 1.0)
    last = block_index(offset, n) == scales.numel() - 1
    assert_same_bits(got[last], param[last])
    assert not torch.equal(got[~last], param[~last])


@pytest.mark.parametrize("explicit_skip", [False, True], ids=["found_inf", "skip_if"])
@pytest.mark.parametrize("pdt", DTYPES)
def test_update_skip_flags(backend, pdt, explicit_skip):
    # A set flag writes nothing (skip_if, or found_inf on entry without skip_if); a zero
    # skip_if updates and records the nan block.
    n, offset = 1000, 300
    param, codes, scales, _ = update_case(n, offset, pdt, seed=4, nan_block=True)
    got, found = param.clone(), torch.full((1,), 0.0 if explicit_skip else 1.0)
    skip_if = torch.full((1,), 2.0) if explicit_skip else None
    ops.lomo_update_int8_(got, codes, scales, offset=offset, lr=LR, found_inf=found,
                          skip_if=skip_if, backend=backend, **OPTIONS["all"])  # fmt: skip
    assert_same_bits(got, param)
    assert found.item() == (0.0 if explicit_skip else 1.0)
    found, skip_if = torch.zeros(1), torch.zeros(1)
    ops.lomo_update_int8_(got, codes, scales, offset=offset, lr=LR, found_inf=found,
                          skip_if=skip_if, backend=backend)  # fmt: skip
    assert found.item() == 1.0 and skip_if.item() == 0.0
    assert not torch.equal(got, param)


@pytest.mark.parametrize("pdt", ["bf16", "fp16"])
def test_update_stochastic_slice_rounds_as_the_whole(backend, pdt):
    # A slice at any offset, updated with that offset, stores the whole parameter's update
    # at its elements; the whole (offset 0) is fused_lomo_update_'s stochastic update.
    n = 1000
    param, codes, scales, grad = update_case(n, 0, pdt, seed=5)
    step = torch.tensor([STEP])
    kwargs = dict(stochastic_rounding=True, seed=SEED, seed_step=step, **OPTIONS["all"])
    (whole, fused), _ = both_updates(backend, param, codes, scales, grad, 0, **kwargs)
    assert_same_bits(whole, fused)
    for start, stop in ((300, n), (300, 700), (1, 257), (255, 256), (512, 999)):
        lo, hi = start // BLOCK, start // BLOCK + block_count(start, stop - start)
        piece = param[start:stop].clone()
        ops.lomo_update_int8_(piece, codes[start:stop], scales[lo:hi], offset=start, lr=LR,
                              backend=backend, **kwargs)  # fmt: skip
        assert_same_bits(piece, whole[start:stop])


def test_update_stochastic_reads_the_whole_64_bit_index(backend):
    param, codes, scales, _ = update_case(4097, 5, "bf16", seed=6)
    kwargs = dict(lr=LR, stochastic_rounding=True, seed=SEED, backend=backend)
    low, high = param.clone(), param.clone()
    ops.lomo_update_int8_(low, codes, scales, offset=5, **kwargs)
    ops.lomo_update_int8_(high, codes, scales, offset=2**32 + 5, **kwargs)
    assert (low != high).double().mean().item() > 0.2


# -- int8_dequantize_ --------------------------------------------------------------------


def dequantize_case(n: int, offset: int, seed: int, low: int, high: int):
    """(codes, scales, model values): scales 2**low .. 2**high, a zero and a nan block."""
    codes, scales = make_buffer(n, offset, seed, low=low, high=high)
    if scales.numel() > 2:
        scales[1] = 0.0
        scales[2] = NAN
    return codes, scales, dequantised(codes, scales, offset)


DEQUANTIZE_CASES = [(n, o) for n in (1, 7, 257, 4097) for o in (0, 255, 2**32 + 5)]


@pytest.mark.parametrize(
    "n,offset", [*DEQUANTIZE_CASES, (LARGE, 2**32 + 5)],
    ids=[f"n{n}-{offset_id(o)}" for n, o in [*DEQUANTIZE_CASES, (LARGE, 2**32 + 5)]],
)  # fmt: skip
@pytest.mark.parametrize("odt", ["fp32", "bf16"])
def test_dequantize_exact(backend, odt, n, offset):
    # Down to the smallest scale; up to 2**120, where 127 * scale is still finite in bf16.
    codes, scales, values = dequantize_case(n, offset, seed=n, low=-126, high=120)
    out = torch.full((n,), 7.0, dtype=DTYPES[odt])
    ops.int8_dequantize_(out, codes, scales, offset=offset, backend=backend)
    got, finite = out.double(), ~values.isnan()
    assert torch.equal(got.isnan(), ~finite)
    assert torch.equal(got[finite], values[finite])


@pytest.mark.parametrize("offset", [0, 255, 2**32 + 5], ids=offset_id)
@pytest.mark.parametrize("n", [7, 257, 4097], ids=lambda n: f"n{n}")
def test_dequantize_fp16_rounds_to_nearest(backend, n, offset):
    # Scales 2**-30 .. 2**8 (127 * 2**8 < 65504): exact in fp16's normal range, rounded to
    # nearest even among its subnormals (below 2**-14).
    codes, scales, values = dequantize_case(n, offset, seed=n, low=-30, high=8)
    out = torch.empty(n, dtype=torch.float16)
    ops.int8_dequantize_(out, codes, scales, offset=offset, backend=backend)
    finite = ~values.isnan()
    assert bool(out[~finite].isnan().all())
    assert_nearest_even(out[finite], values[finite])


def test_dequantize_fp16_overflow(backend):
    # Past fp16's largest value, rounding to nearest gives inf from 65520 on.
    codes = torch.tensor([127, -127, 64, 63, 0, 1], dtype=torch.int8)
    for scale, expected in (
        (2.0**9, [65024.0, -65024.0, 32768.0, 32256.0, 0.0, 512.0]),
        (2.0**10, [INF, -INF, INF, 64512.0, 0.0, 1024.0]),
    ):
        out = torch.empty(6, dtype=torch.float16)
        ops.int8_dequantize_(out, codes, torch.tensor([scale]), backend=backend)
        assert out.double().tolist() == expected
