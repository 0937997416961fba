"""The C++ CPU kernels at every vector level this CPU runs (baseline, AVX2, AVX-512, ...),
each forced in turn: LOMO against the reference backend bit for bit (stochastic rounding of
bf16 and fp16 parameters too), AdaLomo against float64 math and bit for bit across levels,
and its write-back passes with stochastic rounding bit for bit against the reference.

One build holds every level and picks the best the CPU has (csrc/cpu_isa.h); the levels
above this CPU's cannot run here and are not parametrized. Sizes straddle the loops' trips
(16 and 32 elements, 64-byte prefetch lines) and leave tails; the inf/nan specials sit in
the first vectors, one in the middle and the last element.
"""

from __future__ import annotations

import functools
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from support import adalomo
from support.adalomo_write_back import (
    ADALOMO_SR_SHAPES,
    ROUNDING_SEEDS,
    adalomo_write_back,
    assert_same_write_back,
    edge_write_back_case,
    prepared_write_back,
)
from support.fp16_edges import (
    FP16_EDGE_PAIRS,
    check_edge_values_match_reference,
    check_skip_if_writes_nothing,
    check_subnormal_ties_match_reference,
    fp16_any_value_case,
)
from support.grad_accumulate import accumulate_both, assert_same_stored, roundings
from support.int8_compare import (
    SUMSQ_INV,
    Int8Grad,
    assert_same_buffer,
    assert_same_values,
    check_stochastic_ties,
    dequantize_both,
    make_int8_buffer,
    make_int8_grad,
    same_sum,
)
from support.lomo_bitwise import (
    COMBOS,
    DTYPES,
    SR_DTYPES,
    assert_same_bits,
    check_unaligned_views,
    cpp_and_reference,
    grad_scale,
    make_grad,
    make_param,
    option_set,
    option_subset,
    run_update,
)

from lomo_kernels.core.int8_blocks import INT8_BLOCK
from lomo_kernels.ops.adalomo import adalomo_update_, init_adalomo_state
from lomo_kernels.ops.adalomo import cpp_backend as cpp_adalomo
from lomo_kernels.ops.adalomo import reference as adalomo_reference
from lomo_kernels.ops.adalomo.workspace import NUM_SLOTS, SKIP
from lomo_kernels.ops.lomo import cpp_backend as cpp_backend
from lomo_kernels.ops.lomo import reference as reference
from lomo_kernels.ops.lomo.reference import int8_dequantized
from lomo_kernels.tools import env as machine

SIZES = [1, 15, 16, 17, 31, 33, 4099, 65_557]
SR_COMBOS = [(p, g) for p, g in COMBOS if p in SR_DTYPES]
# The CPU flags (/proc/cpuinfo names) each level needs on top of the one below.
LEVEL_FLAGS = {
    "avx2": {"avx2", "f16c"},
    "avx512": {"avx512f", "avx512bw", "avx512dq", "avx512vl"},
    "avx512bf16": {"avx512_bf16"},
}
ENV_VAR = "LOMO_KERNELS_CPU_ISA"


def _extension():
    return cpp_backend._loader.module("cpu")


def _extensions():
    """Both CPU extensions (each holds its own level)."""
    return [_extension(), cpp_adalomo._loader.module("cpu")]


def _levels() -> list[str]:
    return _extension()._cpu_isas() if cpp_backend.is_available("cpu") else ["baseline"]


@pytest.fixture(params=_levels())
def level(request) -> str:
    """Runs the test with the CPU kernels forced to one level, then restores the previous.
    The level is the one the loops run, as their copy says, not only the one named."""
    previous = [ext._set_cpu_isa(request.param) for ext in _extensions()]
    assert [ext._loops_level() for ext in _extensions()] == [request.param] * len(previous)
    yield request.param
    for ext, name in zip(_extensions(), previous, strict=True):
        ext._set_cpu_isa(name)


def test_levels_follow_the_cpu_flags() -> None:
    # Independent of the extension's own detection: the kernel's flags in /proc/cpuinfo.
    flags = machine.cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags on this system")
    expected, needed = ["baseline"], set()
    if os.uname().machine in ("x86_64", "i686"):
        for name, extra in LEVEL_FLAGS.items():
            needed |= extra
            if not needed <= flags:
                break
            expected.append(name)
    assert _extension()._cpu_isas() == expected
    # Without the environment variable the kernels run the best level.
    if not os.environ.get(ENV_VAR):
        assert _extension()._cpu_isa() == expected[-1]


@pytest.mark.parametrize("sr", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("pdt,gdt", COMBOS, ids=[f"p{p}-g{g}" for p, g in COMBOS])
def test_every_level_rounds_fp32_subnormal_results_as_the_reference(level, pdt, gdt, sr):
    """Results around fp32's smallest normal (1.2e-38), half of them subnormal, from finite
    gradients everywhere: no block leaves its vector loop for a non-finite value, so a loop
    that flushes or mis-rounds subnormal results (bf16 keeps them: its range is fp32's) is
    seen. Parameters within a few times 1e-38, lr 1e-38, gradients of order 1."""
    if sr and pdt not in SR_DTYPES:
        pytest.skip("stochastic rounding applies to bf16 and fp16 parameters")
    gen = torch.Generator().manual_seed(7)
    n = 4099
    param = (torch.randn(n, generator=gen) * 2e-38).to(DTYPES[pdt])
    grad = torch.randn(n, generator=gen).to(DTYPES[gdt])
    opts = option_set("plain") | {"lr": 1e-38}
    (got, want), (f_got, f_want) = cpp_and_reference(param, grad, opts, sr=sr, seed=3)
    exact = param.float() - torch.tensor(1e-38) * grad.float()
    tiny = exact.abs() < torch.finfo(torch.float32).tiny
    assert 0.2 < tiny.double().mean() < 0.8 and (exact[tiny] != 0).any()  # the case is met
    assert_same_bits(got, want)
    assert torch.equal(f_got, f_want) and f_got.item() == 0.0


@pytest.mark.parametrize("size", SIZES, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("pdt,gdt", COMBOS, ids=[f"p{p}-g{g}" for p, g in COMBOS])
def test_every_level_matches_reference(level: str, pdt: str, gdt: str, size: int) -> None:
    for k, kind in enumerate(("plain", "full", "tensors")):
        param = make_param(size, DTYPES[pdt], seed=size + k, specials=True)
        grad = make_grad(size, DTYPES[gdt], seed=size + k, scale=grad_scale(kind), specials=True)
        (got, want), (f_got, f_want) = cpp_and_reference(
            param, grad, option_set(kind), with_skip=True
        )
        assert_same_bits(got, want)
        assert torch.equal(f_got, f_want)


@pytest.mark.parametrize("pdt", list(DTYPES))
def test_every_level_option_subset_matches_reference(level: str, pdt: str) -> None:
    # Each option on or neutral, with and without inf/nan gradients; bf16 and fp16 also with
    # stochastic rounding (with and without the per-step seed); clip bounds of 0 and below 0
    # too.
    dtype, n = DTYPES[pdt], 4133
    for bits in range(16):
        opts = option_subset(bits)
        param = make_param(n, dtype, seed=bits, specials=True)
        bad = make_grad(n, dtype, seed=bits, scale=1024.0 if bits & 1 else 1.0, specials=True)
        clean = make_grad(n, dtype, seed=bits + 99, scale=1.0, specials=False)
        for grad, flagged in ((bad, 1.0), (clean, 0.0)):
            (got, want), (f_got, f_want) = cpp_and_reference(param, grad, opts)
            assert_same_bits(got, want)
            assert f_got.item() == f_want.item() == flagged
            if dtype != torch.float32:  # stochastic rounding (bf16 and fp16)
                step = torch.tensor([bits * 977], dtype=torch.int64)
                for seed_step in (None, step):
                    (got, want), _ = cpp_and_reference(
                        param, grad, opts, sr=True, seed=bits, seed_step=seed_step
                    )
                    assert_same_bits(got, want)
    for clip in (0.0, -0.5):
        param = make_param(n, dtype, seed=5, specials=True)
        grad = make_grad(n, dtype, seed=5, scale=1.0, specials=True)
        (got, want), _ = cpp_and_reference(param, grad, option_set("plain") | dict(clip_value=clip))
        assert_same_bits(got, want)


@pytest.mark.parametrize("pdt", list(DTYPES))
def test_every_level_unaligned_views_and_skip(level: str, pdt: str) -> None:
    # Views at odd storage offsets (unaligned vector loads and stores; the elements around
    # them untouched), as test_cpp_backend.py checks them at the best level.
    check_unaligned_views(pdt, pdt)
    # A non-zero skip_if: nothing is written, nothing is flagged.
    param = make_param(4133, DTYPES[pdt], seed=8, specials=True)
    grad = make_grad(4133, DTYPES[pdt], seed=8, scale=1.0, specials=True)
    p, found = param.clone(), torch.zeros(1)
    run_update(cpp_backend, p, grad, option_set("full"), found=found, skip=torch.ones(1))
    assert torch.equal(p.view(torch.uint8), param.view(torch.uint8))
    assert found.item() == 0.0


@pytest.mark.parametrize("size", SIZES, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("pdt,gdt", SR_COMBOS, ids=[f"p{p}-g{g}" for p, g in SR_COMBOS])
def test_every_level_stochastic_rounding_matches_reference(
    level: str, pdt: str, gdt: str, size: int
) -> None:
    # bf16 and fp16 parameters with every gradient dtype, the full option set and the
    # inf/nan specials, with and without the per-step seed.
    param = make_param(size, DTYPES[pdt], seed=size, specials=True)
    grad = make_grad(size, DTYPES[gdt], seed=size, scale=1024.0, specials=True)
    for seed, step in ((7, None), (2**63 - 5, torch.tensor([2**33 + 11], dtype=torch.int64))):
        (got, want), (f_got, f_want) = cpp_and_reference(
            param, grad, option_set("full"), sr=True, seed=seed, seed_step=step
        )
        assert_same_bits(got, want)
        assert torch.equal(f_got, f_want)


@pytest.mark.parametrize("gdt", ["same", "fp32"])
@pytest.mark.parametrize("pdt", SR_DTYPES)
def test_every_level_stochastic_rounding_edge_values(level: str, pdt: str, gdt: str) -> None:
    # fp16's boundaries (subnormals, 2^-14, 65504, inf, nan, -0.0) in the first trip, a middle
    # one, one with a non-finite gradient and the tail (support/fp16_edges.py).
    check_edge_values_match_reference(pdt, gdt)
    check_skip_if_writes_nothing(pdt)


def test_every_level_fp16_subnormal_ties(level: str) -> None:
    # Every element's update a tie of the subnormal rounding: down for an odd random value,
    # up for an even one (support/fp16_edges.py), in every lane and the tail.
    check_subnormal_ties_match_reference(cpp_backend)


def test_every_level_fp16_stochastic_rounding_of_any_fp32_value(level: str) -> None:
    param, grad, opts = fp16_any_value_case(65_557, seed=5)
    for step in (None, torch.tensor([9], dtype=torch.int64)):
        (got, want), _ = cpp_and_reference(param, grad, opts, sr=True, seed=23, seed_step=step)
        assert_same_bits(got, want)


SUMSQ_GRAIN = 32_768  # csrc/lomo_cpu.cpp's kGrain: the fixed chunks of grad_sumsq_
SUMSQ_LANES = 8  # csrc/lomo_cpu_loops.h's kSumLanes


def _lane_order_sumsq(grad: torch.Tensor, inv_scale: float, start: float) -> float:
    """grad_sumsq_'s documented order in float64: per chunk, element i into lane i % 8 in
    sequence, the lanes added in order, the chunks added in order to `start`, one fp32
    rounding at the end. Independent of the kernels: the loops must match it bit for bit."""
    scaled = (grad.float() * torch.tensor(inv_scale, dtype=torch.float32)).double().tolist()
    total = 0.0
    for begin in range(0, len(scaled), SUMSQ_GRAIN):
        lanes = [0.0] * SUMSQ_LANES
        for i, v in enumerate(scaled[begin : begin + SUMSQ_GRAIN]):
            lanes[i % SUMSQ_LANES] += v * v  # exact: a fp32 value squared fits a double
        partial = 0.0
        for lane in lanes:
            partial += lane
        total += partial
    return torch.tensor(start + total, dtype=torch.float64).float().item()


@pytest.mark.parametrize("n", [1, 7, 8, 17, 100_003], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("gdt", list(DTYPES))
def test_grad_sumsq_every_level_matches_lane_order(level: str, gdt: str, n: int) -> None:
    # Every level (the AVX2 loops hold the lanes in vectors of doubles) gives the bits of the
    # stated order; sizes leave tails inside and across the 32768-element chunks.
    # Started at minus the sum's fp32 value, the fp32 result is the double sum's low bits:
    # a different summation order shows there, where one fp32 rounding would hide it.
    grad = make_grad(n, DTYPES[gdt], seed=n, scale=3.0, specials=False)
    for start in (1.25, -_lane_order_sumsq(grad, 0.5, 0.0)):
        out, found = torch.tensor([start]), torch.zeros(1)
        cpp_backend.grad_sumsq_(grad, torch.tensor([0.5]), out, found)
        assert out.item() == _lane_order_sumsq(grad, 0.5, start)
        assert found.item() == 0.0


@pytest.mark.parametrize("n", [43, 40_000], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("gdt", list(DTYPES))
def test_grad_sumsq_every_level_keeps_each_lane(level: str, gdt: str, n: int) -> None:
    # One large square (2^24, ulp 2^-28) in lane `big` and tiny ones (2^-30, under half that
    # ulp) everywhere else: the tiny squares sharing its lane vanish one by one, the other
    # lanes' sums (five or more of them) survive the final adds.
    # Started at -2^24, the fp32 result is what survived, so a loop that puts any element in
    # another lane, or adds the lanes in another order, gives other bits.
    for big in range(SUMSQ_LANES):
        grad = torch.full((n,), 2.0**-14).to(DTYPES[gdt])  # scaled by 0.5: 2^-15
        grad[big] = 2.0**13  # scaled: 2^12
        out = torch.tensor([-(2.0**24)])
        cpp_backend.grad_sumsq_(grad, torch.tensor([0.5]), out, None)
        assert out.item() == _lane_order_sumsq(grad, 0.5, -(2.0**24))
        assert out.item() != 0.0


@pytest.mark.parametrize("where", ["first", "vector body", "tail"])
@pytest.mark.parametrize("special", ["inf", "-inf", "nan", "overflow"])
@pytest.mark.parametrize("gdt", list(DTYPES))
def test_grad_sumsq_every_level_flags_non_finite(
    level: str, gdt: str, special: str, where: str
) -> None:
    # The loops flag a non-finite scaled element through the non-finite total; "overflow" is
    # a finite gradient that the inverse scale (2.0 here) takes past the dtype's fp32 range
    # (fp16's largest is not: it stays finite and must not be flagged).
    n = 4_101  # 512 vectors of 8 and a tail of 5
    grad = make_grad(n, DTYPES[gdt], seed=9, scale=1.0, specials=False)
    value = {"inf": float("inf"), "-inf": float("-inf"), "nan": float("nan")}.get(
        special, torch.finfo(DTYPES[gdt]).max
    )
    index = {"first": 0, "vector body": 2_053, "tail": n - 2}[where]
    grad[index] = value
    out, found = torch.zeros(1), torch.zeros(1)
    cpp_backend.grad_sumsq_(grad, torch.tensor([2.0]), out, found)
    scaled = grad[index].float() * 2.0
    expect_flag = not torch.isfinite(scaled).item()
    assert found.item() == float(expect_flag)
    if not expect_flag:
        assert out.item() == _lane_order_sumsq(grad, 2.0, 0.0)


# ----------------------------------------------------------------------------- accumulation


@pytest.mark.parametrize("size", SIZES, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("bdt,gdt", COMBOS, ids=[f"b{b}-g{g}" for b, g in COMBOS])
def test_grad_accumulate_every_level_matches_reference(
    level: str, bdt: str, gdt: str, size: int
) -> None:
    # Stored bits as the reference's (both roundings, adding and the first pass), the sum of
    # squares in grad_sumsq_'s documented lane order of the stored values, bit for bit.
    buffer = make_param(size, DTYPES[bdt], seed=size, specials=False)
    grad = make_grad(size, DTYPES[gdt], seed=size, scale=3.0, specials=False)
    inv = torch.tensor([0.5])
    for first in (False, True):
        for sr in roundings(bdt):
            (got, want), (s_got, _), (f_got, f_want) = accumulate_both(
                cpp_backend, buffer, grad, first=first, inv_scale=inv, sr=sr, seed=size,
                seed_step=torch.tensor([size * 31], dtype=torch.int64), start=1.25,
            )  # fmt: skip
            assert_same_stored(got, want)
            assert f_got.item() == f_want.item() == 0.0
            assert s_got.item() == _lane_order_sumsq(got, 0.5, 1.25)
            # The flag alone (the loops that track the largest magnitude): the same bits.
            (alone, _), _, (f_alone, _) = accumulate_both(
                cpp_backend, buffer, grad, first=first, inv_scale=inv, sr=sr, seed=size,
                seed_step=torch.tensor([size * 31], dtype=torch.int64), squares=False,
            )  # fmt: skip
            assert_same_stored(alone, got)
            assert f_alone.item() == 0.0
            # Started at minus the sum, the fp32 result shows the double sum's low bits.
            start = -_lane_order_sumsq(got, 0.5, 0.0)
            again = buffer.clone()
            sumsq = torch.tensor([start])
            cpp_backend.grad_accumulate_(again, grad, first, inv, sumsq, None, sr, size, None, 0)
            assert sumsq.item() == _lane_order_sumsq(again, 0.5, start)


# Slices at flat offsets: heads of 31, 27 (not a multiple of the squares' 8 lanes) and 24
# elements before a multiple of 32, none, and slices across and past 2**32; 65_557 elements
# span three of the threads' chunks, each after the first starting off a multiple of 32.
SLICE_OFFSETS = [1, 5, 8, 64, 2**32 - 40, 2**32 + 7]


@pytest.mark.parametrize("offset", SLICE_OFFSETS)
@pytest.mark.parametrize("size", [33, 4099, 65_557], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("bdt,gdt", [("bf16", "bf16"), ("bf16", "fp32"), ("fp16", "fp16")])
def test_grad_accumulate_slices_every_level(
    level: str, bdt: str, gdt: str, size: int, offset: int
) -> None:
    # A slice's stored bits as the reference's, its squares still in grad_sumsq_'s lane order
    # of the written slice bit for bit (the vector loops start after the head), and the
    # flag-alone loops' bits the same.
    buffer = make_param(size, DTYPES[bdt], seed=size, specials=False)
    grad = make_grad(size, DTYPES[gdt], seed=size + 1, scale=3.0, specials=False)
    inv = torch.tensor([0.5])
    for first in (False, True):
        (got, want), (s_got, _), (f_got, f_want) = accumulate_both(
            cpp_backend, buffer, grad, first=first, inv_scale=inv, sr=True, seed=size,
            seed_step=torch.tensor([7], dtype=torch.int64), start=1.25, offset=offset,
        )  # fmt: skip
        assert_same_stored(got, want)
        assert f_got.item() == f_want.item() == 0.0
        assert s_got.item() == _lane_order_sumsq(got, 0.5, 1.25)
        (alone, _), _, _ = accumulate_both(
            cpp_backend, buffer, grad, first=first, inv_scale=inv, sr=True, seed=size,
            seed_step=torch.tensor([7], dtype=torch.int64), squares=False, offset=offset,
        )  # fmt: skip
        assert_same_stored(alone, got)


@pytest.mark.parametrize("offset", [3, 5], ids=["head29", "head27"])
@pytest.mark.parametrize("bdt", SR_DTYPES)
def test_grad_accumulate_slice_keeps_each_lane(level: str, bdt: str, offset: int) -> None:
    # grad_sumsq_'s lane test (above) on a slice whose head is not a multiple of the 8 lanes:
    # the large square at element head + 64 + big of the vector loops' part must land in
    # lane (head + 64 + big) % 8 of the chunk, as the tiny ones around it. A zero gradient
    # stores the buffer's values exactly, stochastic rounding or not.
    head = 32 - offset
    for big in range(SUMSQ_LANES):
        buffer = torch.full((200,), 2.0**-14).to(DTYPES[bdt])  # scaled by 0.5: 2^-15
        buffer[head + 64 + big] = 2.0**13  # scaled: 2^12
        grad = torch.zeros(200, dtype=DTYPES[bdt])
        out = torch.tensor([-(2.0**24)])
        cpp_backend.grad_accumulate_(buffer, grad, False, torch.tensor([0.5]), out, None, True,
                                     9, None, offset)  # fmt: skip
        assert out.item() == _lane_order_sumsq(buffer, 0.5, -(2.0**24))
        assert out.item() != 0.0


@pytest.mark.parametrize("squares", [True, False], ids=["squares", "flag alone"])
@pytest.mark.parametrize("where", [2, 40, 198], ids=["head", "vector body", "tail"])
@pytest.mark.parametrize("special", ["inf", "nan"])
def test_grad_accumulate_slice_flags_non_finite(
    level: str, special: str, where: int, squares: bool
) -> None:
    # A non-finite sum in a slice's head (offset 5: 27 elements), its vector part or its tail
    # raises found_inf as the reference does, from the squares' total or the flag alone.
    buffer = make_param(200, torch.bfloat16, seed=4, specials=False)
    grad = make_grad(200, torch.bfloat16, seed=5, scale=1.0, specials=False)
    grad[where] = float(special)
    _, _, (f_got, f_want) = accumulate_both(
        cpp_backend, buffer, grad, inv_scale=torch.tensor([0.5]), sr=True, seed=2,
        squares=squares, offset=5,
    )  # fmt: skip
    assert f_got.item() == f_want.item() == 1.0


@pytest.mark.parametrize("offset", SLICE_OFFSETS)
@pytest.mark.parametrize("pdt,gdt", SR_COMBOS, ids=[f"p{p}-g{g}" for p, g in SR_COMBOS])
def test_update_slices_every_level(level: str, pdt: str, gdt: str, offset: int) -> None:
    size = 4099
    param = make_param(size, DTYPES[pdt], seed=size, specials=True)
    grad = make_grad(size, DTYPES[gdt], seed=size, scale=grad_scale("full"), specials=True)
    (got, want), (f_got, f_want) = cpp_and_reference(
        param, grad, option_set("full"), sr=True, seed=3 << 32, offset=offset
    )
    assert_same_bits(got, want)
    assert torch.equal(f_got, f_want)


@pytest.mark.parametrize("squares", [True, False], ids=["squares", "flag alone"])
@pytest.mark.parametrize("where", ["first", "vector body", "tail"])
@pytest.mark.parametrize("special", ["inf", "nan", "overflow"])
@pytest.mark.parametrize(
    "bdt,gdt", [("fp32", "fp32"), ("bf16", "bf16"), ("fp16", "fp16"), ("bf16", "fp32")]
)
def test_grad_accumulate_every_level_flags_non_finite(
    level: str, bdt: str, gdt: str, special: str, where: str, squares: bool
) -> None:
    # A non-finite stored value, wherever it sits, raises found_inf and makes the sum
    # non-finite; "overflow": a finite stored value the inverse scale (2.0) takes past fp32
    # (the dtype's largest; fp16's stays finite and must not be flagged). With the flag
    # alone (no sumsq) the loops track the largest magnitude instead of the squares.
    n = 4_101
    buffer = make_param(n, DTYPES[bdt], seed=4, specials=False)
    grad = make_grad(n, DTYPES[gdt], seed=4, scale=1.0, specials=False)
    index = {"first": 0, "vector body": 2_053, "tail": n - 2}[where]
    if special == "overflow":
        buffer[index], grad[index] = torch.finfo(DTYPES[bdt]).max, 0.0
    else:
        grad[index] = float(special)
    for sr in roundings(bdt):
        (got, want), (s_got, _), (f_got, f_want) = accumulate_both(
            cpp_backend, buffer, grad, inv_scale=torch.tensor([2.0]), sr=sr, seed=1,
            squares=squares,
        )  # fmt: skip
        assert_same_stored(got, want)
        flagged = not torch.isfinite(got[index].float() * 2.0).item()
        assert f_got.item() == f_want.item() == float(flagged)
        if squares:
            assert s_got.isfinite().item() != flagged


@pytest.mark.parametrize("where", ["first", "vector body", "tail"])
@pytest.mark.parametrize("inv_scale", [1e30, 1e34], ids=["65504 x inv finite", "overflows"])
@pytest.mark.parametrize("bdt", ["fp16", "bf16", "fp32"])
def test_grad_accumulate_flag_alone_at_a_huge_inverse_scale(
    level: str, bdt: str, inv_scale: float, where: str
) -> None:
    # The flag alone looks at every stored value times inv_scale, including fp16's normal-range
    # values, which it skips only where 65504 * inv_scale is finite (1e30; 1e34 overflows): a
    # moderate buffer is not flagged, one value of 40000 is at 1e34 only (4e38 > fp32's
    # largest), wherever it sits; as the reference and the squares say.
    n = 4_101
    buffer = make_param(n, DTYPES[bdt], seed=6, specials=False)
    grad = make_grad(n, DTYPES[bdt], seed=6, scale=1.0, specials=False)
    inv = torch.tensor([inv_scale])
    for big in (False, True):
        if big:
            buffer[{"first": 0, "vector body": 2_053, "tail": n - 2}[where]] = 40_000.0
        for sr in roundings(bdt):
            (got, want), _, (f_got, f_want) = accumulate_both(
                cpp_backend, buffer, grad, inv_scale=inv, sr=sr, seed=2, squares=False
            )
            _, (s_squares, _), (f_squares, _) = accumulate_both(
                cpp_backend, buffer, grad, inv_scale=inv, sr=sr, seed=2
            )
            assert_same_stored(got, want)
            flagged = not torch.isfinite(got.float().abs().max() * inv_scale).item()
            assert flagged == (big and inv_scale == 1e34)
            assert f_got.item() == f_want.item() == f_squares.item() == float(flagged)


# ----------------------------------------------------------------------------- 8-bit buffer

# Sizes from one element to past one chunk of whole blocks (128 blocks, 32768 elements), and
# offsets mid-block, on a block's last element and past 2^32.
INT8_SIZES = [1, 33, 257, 4099, 65_557]
INT8_OFFSETS = [0, 255, 2**32 + 5]
INT8_CHUNK = SUMSQ_GRAIN // INT8_BLOCK  # csrc/lomo_cpu.cpp: the accumulation's chunk, in blocks
INT8_LANES = 32  # csrc/lomo_cpu_int8.h's kInt8Lanes


def _int8_lane_order_total(
    codes: torch.Tensor, scales: torch.Tensor, offset: int, inv_scale: float
) -> float:
    """grad_accumulate_int8_'s documented order in float64: the stored values times inv_scale
    (fp32), per chunk of INT8_CHUNK blocks from the buffer's first, element j into lane
    (offset + j) % 32 in sequence, the lanes added in order, the chunks in order from 0 (the
    kernel then adds the total to sumsq, rounded once to fp32). Independent of the kernels:
    every level must give its bits."""
    inv = torch.tensor(inv_scale, dtype=torch.float32)
    scaled = (int8_dequantized(codes, scales, offset) * inv).double().tolist()
    lead, total = offset % INT8_BLOCK, 0.0
    for block in range(0, scales.numel(), INT8_CHUNK):
        begin = max(0, block * INT8_BLOCK - lead)
        end = min(len(scaled), (block + INT8_CHUNK) * INT8_BLOCK - lead)
        lanes = [0.0] * INT8_LANES
        for j in range(begin, end):
            lanes[(offset + j) % INT8_LANES] += scaled[j] * scaled[j]
        partial = 0.0
        for lane in lanes:
            partial += lane
        total += partial
    return total


@functools.cache
def _int8_accumulated(gdt: str, size: int, offset: int, first: bool, sr: bool):
    """The reference's grad_accumulate_int8_ of a case, once for every level: its inputs
    (codes, scales, grad, inv_scale), (codes, scales, found_inf) and the lane-order total of
    the sum of squares."""
    codes, scales = make_int8_buffer(size, offset, seed=size, dtype=DTYPES[gdt])
    grad = make_int8_grad(size, DTYPES[gdt], offset, seed=size + 1)
    inv = torch.tensor([SUMSQ_INV[DTYPES[gdt]]])
    want = codes.clone(), scales.clone(), torch.zeros(1)
    reference.grad_accumulate_int8_(
        want[0], want[1], grad, offset, first, inv, None, want[2], sr, size, None
    )
    return (codes, scales, grad, inv), want, _int8_lane_order_total(*want[:2], offset, inv.item())


@pytest.mark.parametrize("size", INT8_SIZES, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("gdt", list(DTYPES))
def test_grad_accumulate_int8_every_level_matches_reference(
    level: str, gdt: str, size: int
) -> None:
    # Codes, scales and flag as the reference's; the sum of squares in the documented lane order
    # bit for bit (started at minus the sum too: the fp32 result then shows the double sum's
    # low bits), so every level adds the same sums.
    for offset in INT8_OFFSETS:
        for first, sr in ((False, False), (False, True), (True, False), (True, True)):
            (codes, scales, grad, inv), want, total = _int8_accumulated(
                gdt, size, offset, first, sr
            )
            for start in (1.25, -torch.tensor(total).float().item()):
                c, s, sumsq, found = (
                    codes.clone(),
                    scales.clone(),
                    torch.tensor([start]),
                    torch.zeros(1),
                )
                cpp_backend.grad_accumulate_int8_(
                    c, s, grad, offset, first, inv, sumsq, found, sr, size, None
                )
                assert_same_buffer((c, want[0]), (s, want[1]))
                assert torch.equal(found, want[2])
                expected = torch.tensor(start + total, dtype=torch.float64).float()
                assert same_sum(sumsq, expected.reshape(1))
            # The flag alone (no sumsq): the same store and flag.
            c, s, found = codes.clone(), scales.clone(), torch.zeros(1)
            cpp_backend.grad_accumulate_int8_(
                c, s, grad, offset, first, inv, None, found, sr, size, None
            )
            assert_same_buffer((c, want[0]), (s, want[1]))
            assert torch.equal(found, want[2])


@pytest.mark.parametrize(("size", "offset"), [(257, 0), (4097, 300), (4097, 2**32 + 5)])
def test_grad_accumulate_int8_stochastic_ties_every_level(level: str, size: int, offset: int):
    # Every element a tie of the stochastic rounding (x + u an integer): rounded down for an
    # odd random value, up for an even one, at every level as in the reference.
    check_stochastic_ties(cpp_backend, size, offset, None)


@pytest.mark.parametrize("inv_scale", [math.inf, -math.inf])
@pytest.mark.parametrize(("size", "offset"), [(17, 256), (300, 100), (513, 0)])
def test_grad_accumulate_int8_infinite_inverse_scale_every_level(
    level: str, size: int, offset: int, inv_scale: float
) -> None:
    # Stored values all non-zero (codes of values in [0.5, 1)) times an infinite inv_scale (a
    # loss scale fallen to 0): every square is inf, so the sum is the reference's inf. A
    # partial block's padding is no element: its 0 * inf (nan) must not enter the sum.
    grad = 0.5 + 0.5 * torch.rand(size, generator=torch.Generator().manual_seed(size))
    inv = torch.tensor([inv_scale])
    for first in (True, False):
        # Not first: an all-zero buffer, so the stored values are the gradient's again.
        codes, scales = (t.zero_() for t in make_int8_buffer(size, offset, seed=size))
        want = codes.clone(), scales.clone(), torch.zeros(1), torch.zeros(1)
        reference.grad_accumulate_int8_(
            want[0], want[1], grad, offset, first, inv, want[2], want[3], False, 0, None
        )
        assert want[2].item() == math.inf  # the case is what it claims
        got = codes.clone(), scales.clone(), torch.zeros(1), torch.zeros(1)
        cpp_backend.grad_accumulate_int8_(
            got[0], got[1], grad, offset, first, inv, got[2], got[3], False, 0, None
        )
        assert_same_buffer((got[0], want[0]), (got[1], want[1]))
        assert torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])


@functools.cache
def _int8_updated(pdt: str, offset: int, bits: int, sr: bool):
    """The reference's lomo_update_int8_ of a case (option subset `bits`), once for every
    level: its inputs and (param, found_inf)."""
    n = 4133
    codes, scales = make_int8_buffer(n, offset, seed=bits)
    param = make_param(n, DTYPES[pdt], seed=bits, specials=True)
    want, found = param.clone(), torch.zeros(1)
    run_update(
        Int8Grad(reference, codes, scales, offset), want, None, option_subset(bits),
        found=found, sr=sr, seed=bits,
    )  # fmt: skip
    return (param, codes, scales), (want, found)


@pytest.mark.parametrize("pdt", list(DTYPES))
def test_lomo_update_int8_every_level_matches_reference(level: str, pdt: str) -> None:
    # Each option on or neutral, bf16 and fp16 also stochastically; the buffer's nan block keeps
    # its elements and raises found_inf.
    for offset in (1, 2**32 + 5):
        for bits in range(16):
            for sr in roundings(pdt):
                (param, codes, scales), (want, f_want) = _int8_updated(pdt, offset, bits, sr)
                got, found = param.clone(), torch.zeros(1)
                run_update(
                    Int8Grad(cpp_backend, codes, scales, offset), got, None, option_subset(bits),
                    found=found, sr=sr, seed=bits,
                )  # fmt: skip
                assert_same_bits(got, want)
                assert torch.equal(found, f_want)


@pytest.mark.parametrize("odt", list(DTYPES))
def test_int8_dequantize_every_level_matches_reference(level: str, odt: str) -> None:
    for size in INT8_SIZES:
        for offset in INT8_OFFSETS:
            codes, scales = make_int8_buffer(size, offset, seed=size)
            got, want = dequantize_both(cpp_backend, DTYPES[odt], codes, scales, offset)
            assert_same_values(got, want)


ADALOMO_SHAPES = [(4097,), (17, 33), (64, 1029), (2, 3, 7), (1, 70_001)]
ADALOMO_OPTIONS = dict(
    inv_scale=2.0**-10, clip_value=1.0, clip_coef=torch.tensor([0.37]), weight_decay=0.01
)


def _adalomo_start(shape, dtype) -> tuple[torch.Tensor, torch.Generator]:
    gen = torch.Generator().manual_seed(len(shape) * 1000 + shape[-1])
    return torch.randn(shape, generator=gen).to(dtype), gen


def _adalomo_steps(shape, dtype) -> tuple[torch.Tensor, dict]:
    """Three AdaLomo steps of the C++ backend from a fixed start; the parameter and state."""
    param, gen = _adalomo_start(shape, dtype)
    state = init_adalomo_state(param)
    for t in range(1, 4):
        grad = (torch.randn(shape, generator=gen) * 2.0**10 / t).to(dtype)
        beta2 = 1.0 - t**-0.8
        adalomo_update_(param, grad, state, lr=0.05, beta2=beta2, backend="cpp", **ADALOMO_OPTIONS)
    return param, state


@pytest.mark.parametrize("pdt", list(DTYPES))
@pytest.mark.parametrize("shape", ADALOMO_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_adalomo_bit_identical_at_every_level(shape, pdt: str) -> None:
    # Elementwise fp32 math and fixed-lane double sums: the same bits at every level, and at
    # each level two steps with every option within support/adalomo.py's float64 bounds.
    results = {}
    previous = [ext._set_cpu_isa("baseline") for ext in _extensions()]
    try:
        for name in _levels():
            for ext in _extensions():
                ext._set_cpu_isa(name)
                assert ext._loops_level() == name
            results[name] = _adalomo_steps(shape, DTYPES[pdt])
            adalomo.run_steps("cpp", shape, DTYPES[pdt], adalomo.OPTIONS["all"], 2)
    finally:
        for ext, name in zip(_extensions(), previous, strict=True):
            ext._set_cpu_isa(name)
    param, state = results["baseline"]
    assert not torch.equal(param, _adalomo_start(shape, DTYPES[pdt])[0])  # it ran
    for name, (other, other_state) in results.items():
        assert torch.equal(other.view(torch.uint8), param.view(torch.uint8)), name
        for key, value in state.items():
            assert torch.equal(other_state[key], value), (name, key)


# ----------------------------------------------------------------------------- AdaLomo write-back
# The write-back passes (factored_apply_, vector_apply_) with stochastic rounding: given the
# same workspace and moments, the C++ pass and the reference store the same bits (their fp32
# math agrees: correctly rounded sqrt and division, no contraction), so each is compared bit
# for bit; the passes before them are the reference's.


@pytest.mark.parametrize("shape", ADALOMO_SR_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("gdt", ["same", "fp32"])
@pytest.mark.parametrize("pdt", SR_DTYPES)
def test_adalomo_write_back_stochastic_rounding_matches_reference(
    level: str, pdt: str, gdt: str, shape
) -> None:
    # Index of each element: its flat index in the whole parameter (row * cols + col), so
    # every split into threads and row segments rounds as the reference's tiles do.
    inputs = prepared_write_back(shape, pdt, pdt if gdt == "same" else gdt)
    for seed, step in ROUNDING_SEEDS:
        got = adalomo_write_back(cpp_adalomo, *inputs, sr=True, seed=seed, seed_step=step)
        want = adalomo_write_back(adalomo_reference, *inputs, sr=True, seed=seed, seed_step=step)
        assert_same_write_back(got, want)
    nearest = adalomo_write_back(cpp_adalomo, *inputs, sr=False)
    assert_same_write_back(nearest, adalomo_write_back(adalomo_reference, *inputs, sr=False))
    if got[0].numel() >= 4097:  # about half the elements round the other way
        differ = (got[0] != nearest[0]).float().mean().item()
        assert 0.2 < differ < 0.6, differ


def test_adalomo_write_back_stochastic_rounding_ignored_for_fp32(level: str) -> None:
    for shape in ((4097,), (37, 1031)):
        inputs = prepared_write_back(shape, "fp32", "fp32")
        got = adalomo_write_back(cpp_adalomo, *inputs, sr=True, seed=3)
        assert_same_write_back(got, adalomo_write_back(cpp_adalomo, *inputs, sr=False))


@pytest.mark.parametrize(
    "shape", [(65_557,), (37, 1031), (3, 50)], ids=lambda s: "x".join(map(str, s))
)
@pytest.mark.parametrize("gdt", ["same", "fp32"])
@pytest.mark.parametrize("pdt", SR_DTYPES)
def test_adalomo_write_back_stochastic_rounding_edge_values(
    level: str, pdt: str, gdt: str, shape
) -> None:
    *inputs, hyper = edge_write_back_case(pdt, pdt if gdt == "same" else gdt, shape)
    if math.prod(shape) < 4 * len(FP16_EDGE_PAIRS):
        pytest.skip("too small for four edge groups")
    for seed, step in ROUNDING_SEEDS:
        got = adalomo_write_back(cpp_adalomo, *inputs, sr=True, seed=seed, seed_step=step, **hyper)
        want = adalomo_write_back(
            adalomo_reference, *inputs, sr=True, seed=seed, seed_step=step, **hyper
        )
        assert_same_write_back(got, want, any_nan=True)
        assert got[0].isinf().any() and got[0].isnan().any()
    got = adalomo_write_back(cpp_adalomo, *inputs, sr=False, **hyper)
    want = adalomo_write_back(adalomo_reference, *inputs, sr=False, **hyper)
    assert_same_write_back(got, want, any_nan=True)


@pytest.mark.parametrize("shape", [(4097,), (37, 1031)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("pdt", SR_DTYPES)
def test_adalomo_stochastic_rounding_skip_writes_nothing(level: str, pdt: str, shape) -> None:
    # A set SKIP slot: the write-back leaves every bit; skip_if set: the whole step does.
    param, grad, state, workspace = prepared_write_back(shape, pdt, pdt)
    skipped = workspace.clone()
    skipped[skipped.numel() - NUM_SLOTS + SKIP] = 1.0
    step = torch.tensor([4], dtype=torch.int64)
    got = adalomo_write_back(
        cpp_adalomo, param, grad, state, skipped, sr=True, seed=9, seed_step=step
    )
    assert_same_write_back(got, (param, state))
    p, s, found = param.clone(), {}, torch.zeros(1)
    adalomo_update_(
        p, grad, s, lr=0.05, beta2=0.5, found_inf=found, skip_if=torch.ones(1),
        stochastic_rounding=True, seed=9, seed_step=step, backend="cpp",
    )  # fmt: skip
    assert torch.equal(p.view(torch.int16), param.view(torch.int16))
    assert found.item() == 0.0
    assert all(torch.equal(v, torch.zeros_like(v)) for v in s.values())


def test_unknown_level_refused_and_level_kept() -> None:
    for ext in _extensions():
        before = ext._cpu_isa()
        with pytest.raises(RuntimeError, match="not a CPU loop level; use one of baseline"):
            ext._set_cpu_isa("sse9")
        assert ext._cpu_isa() == before
        above = [name for name in ("avx2", "avx512", "avx512bf16") if name not in _levels()]
        if above:
            with pytest.raises(RuntimeError, match="supports at most"):
                ext._set_cpu_isa(above[0])
            assert ext._cpu_isa() == before


_CHILD = textwrap.dedent(
    """
    import os
    import torch
    from lomo_kernels.ops.lomo import cpp_backend as cpp
    ext = cpp._loader.module("cpu")
    lr = torch.tensor([0.5])
    for value in ("bogus", "baseline", "avx2"):
        os.environ["LOMO_KERNELS_CPU_ISA"] = value
        p, g = torch.ones(40), torch.ones(40)
        try:
            cpp.lomo_update_(p, g, lr, None, None, None, 0.0, None, None, False, 0, None, 0)
        except RuntimeError as exc:
            print("refused", bool(torch.all(p == 1)), str(exc).splitlines()[0])
        else:
            print("ran", ext._cpu_isa(), ext._loops_level(), p[0].item())
    """
)


def test_environment_variable_picks_the_level() -> None:
    # Read at the first call that succeeds: an unknown level is refused before any write, a
    # valid one runs, and later changes to the variable are ignored.
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    refused, ran, ignored = out.stdout.splitlines()
    assert refused.startswith("refused True"), refused
    assert ENV_VAR in refused and "bogus" in refused
    assert ran.split() == ["ran", "baseline", "baseline", "0.5"]
    assert ignored.split() == ["ran", "baseline", "baseline", "0.5"]
