"""C++ CPU backend against the reference backend (bit for bit) and float64 math (1 ulp).

The cases (support/lomo_bitwise.py, support/fp16_edges.py) are those that test_cpu_dispatch.py
runs at every CPU level and test_cuda.py on a GPU. The first run JIT-builds the extension
(about a minute); later runs load it from the cache.
"""

from __future__ import annotations

import math
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from support.float64 import as_f32, sumsq_rel_bound, ulp
from support.fp16_edges import (
    TINY16,
    check_edge_values_match_reference,
    check_skip_if_writes_nothing,
    fp16_any_value_case,
)
from support.grad_accumulate import accumulate_both, assert_same_stored, roundings
from support.int8_compare import OFFSETS as INT8_OFFSETS
from support.int8_compare import SIZES as INT8_SIZES
from support.int8_compare import (
    SUMSQ_INV,
    Int8Grad,
    accumulate_int8_both,
    assert_same_buffer,
    assert_same_values,
    dequantize_both,
    make_int8_buffer,
    make_int8_grad,
    update_int8_both,
)
from support.lomo_bitwise import (
    COMBOS,
    DTYPES,
    INF,
    NAN,
    OPTION_SUBSETS,
    SR_DTYPES,
    assert_same_bits,
    check_unaligned_views,
    cpp_and_reference,
    grad_scale,
    int_bits,
    make_grad,
    make_param,
    option_set,
    option_subset,
    run_update,
)

from lomo_kernels.core.int8_blocks import INT8_BLOCK, blocks_of
from lomo_kernels.ops.lomo import cpp_backend as cpp_backend
from lomo_kernels.ops.lomo import reference as reference

CSRC = Path(__file__).resolve().parents[2] / "csrc"
SIZES = [1, 7, 15, 16, 4097, 278011, 2**20 + 3]


@pytest.fixture(scope="module", autouse=True)
def built_extension() -> None:
    # A failed build is a test failure here, not a skip: the reason says what broke.
    assert cpp_backend.is_available("cpu"), cpp_backend.unavailable_reason("cpu")


# ---------------------------------------------------------------------------------------
# Bit-exactness against the reference backend
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", SIZES, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("pdt,gdt", COMBOS, ids=[f"p{p}-g{g}" for p, g in COMBOS])
def test_matches_reference_bitwise(pdt: str, gdt: str, size: int) -> None:
    kind = ("plain", "full", "tensors")[size % 3]
    param = make_param(size, DTYPES[pdt], seed=size, specials=True)
    grad = make_grad(size, DTYPES[gdt], seed=size, scale=grad_scale(kind), specials=True)
    (got, want), (f_got, f_want) = cpp_and_reference(param, grad, option_set(kind), with_skip=True)
    assert_same_bits(got, want)
    assert torch.equal(f_got, f_want)


@pytest.mark.parametrize("kind", ["plain", "full", "tensors"])
@pytest.mark.parametrize("pdt,gdt", COMBOS, ids=[f"p{p}-g{g}" for p, g in COMBOS])
def test_option_sets_match_reference(pdt: str, gdt: str, kind: str) -> None:
    n = 50_021
    param = make_param(n, DTYPES[pdt], seed=7, specials=True)
    grad = make_grad(n, DTYPES[gdt], seed=7, scale=grad_scale(kind), specials=True)
    (got, want), (f_got, f_want) = cpp_and_reference(param, grad, option_set(kind))
    assert_same_bits(got, want)
    assert f_got.item() == f_want.item() == 1.0


@pytest.mark.parametrize("pdt,gdt", COMBOS, ids=[f"p{p}-g{g}" for p, g in COMBOS])
def test_unaligned_views_match_reference(pdt: str, gdt: str) -> None:
    check_unaligned_views(pdt, gdt)


@pytest.mark.parametrize("bits", OPTION_SUBSETS, ids=lambda b: f"options{b:04b}")
@pytest.mark.parametrize("pdt", ["fp32", "bf16", "fp16"])
def test_every_option_subset_matches_reference(pdt: str, bits: int) -> None:
    # Same-dtype pairs take the vector loops; sizes leave a tail after whole vectors, and
    # the specials (inf/nan grads, subnormal params and results) sit in the first vectors.
    dtype = DTYPES[pdt]
    for n in (4099, 64 * 1024 + 37):
        param = make_param(n, dtype, seed=bits, specials=True)
        grad = make_grad(n, dtype, seed=bits, scale=1024.0 if bits & 1 else 1.0, specials=True)
        (got, want), (f_got, f_want) = cpp_and_reference(param, grad, option_subset(bits))
        assert_same_bits(got, want)
        assert f_got.item() == f_want.item() == 1.0
        clean = make_grad(n, dtype, seed=bits + 99, scale=1.0, specials=False)
        (got, want), (f_got, f_want) = cpp_and_reference(param, clean, option_subset(bits))
        assert_same_bits(got, want)
        assert f_got.item() == f_want.item() == 0.0
        if dtype != torch.float32:  # the stochastic-rounding vector loops, same subsets
            step = torch.tensor([bits * 977], dtype=torch.int64)
            for g in (grad, clean):
                (got, want), _ = cpp_and_reference(
                    param, g, option_subset(bits), sr=True, seed=bits
                )
                assert_same_bits(got, want)
                (got, want), _ = cpp_and_reference(
                    param, g, option_subset(bits), sr=True, seed=bits, seed_step=step
                )
                assert_same_bits(got, want)


@pytest.mark.parametrize("clip", [0.0, -0.5])
@pytest.mark.parametrize("pdt", ["fp32", "bf16"])
def test_zero_and_negative_clip_bounds_match_reference(pdt: str, clip: float) -> None:
    # The public op refuses clip_value <= 0; the backend still follows torch.clamp for it
    # (a negative bound leaves the vector loops' one-instruction clamp for the generic one).
    n = 4099
    param = make_param(n, DTYPES[pdt], seed=5, specials=True)
    grad = make_grad(n, DTYPES[pdt], seed=5, scale=1.0, specials=True)
    opts = option_set("plain") | dict(clip_value=clip)
    (got, want), _ = cpp_and_reference(param, grad, opts)
    assert_same_bits(got, want)


def test_decay_scalar_paths_match_reference() -> None:
    # 1 - lr*wd is formed in fp32 from the device lr, whatever the lr: reproduced bit for bit,
    # including where it differs from the decay formed in double (lr = wd = 0.3).
    param = make_param(10_007, torch.float32, seed=11, specials=False)
    grad = make_grad(10_007, torch.float32, seed=11, scale=1.0, specials=False)
    for lr, wd in [(0.1, 0.3), (0.3, 0.3), (0.37 * 0.71, 0.013)]:
        opts = option_set("plain") | dict(lr=lr, weight_decay=wd)
        (got, want), _ = cpp_and_reference(param, grad, opts)
        assert_same_bits(got, want)
        # The decay of the documented math: fp32(1 - fp32(fp32(lr) * fp32(wd))), then
        # p * decay - lr * g in fp32 operations.
        lr32 = torch.tensor(lr, dtype=torch.float32)
        decay32 = 1.0 - lr32 * torch.tensor(wd, dtype=torch.float32)
        assert_same_bits(got, param * decay32 - lr32 * grad)


# ---------------------------------------------------------------------------------------
# Error bound against float64 math
# ---------------------------------------------------------------------------------------


def _float64_update(param, grad, opts):
    """The update in float64 from the fp32-rounded scalars the kernel sees.

    Returns (exact new value, p * decay, lr * g, skip mask of the kernel).
    """
    lr = as_f32(opts["lr"])
    # 1 - lr * wd in fp32 from the fp32 lr (the product of two fp32 values is exact in double).
    decay = as_f32(1.0 - as_f32(lr * as_f32(opts["weight_decay"])))
    inv = 1.0 if opts["inv_scale"] is None else as_f32(opts["inv_scale"])
    coef = 1.0 if opts["clip_coef"] is None else as_f32(opts["clip_coef"])
    bad = ~torch.isfinite(grad.float() * inv)  # the kernel tests the fp32 product
    g = grad.double() * inv
    if opts["clip_value"] is not None:
        clip = as_f32(opts["clip_value"])
        g = g.clamp(-clip, clip)
    g = g * coef
    shrunk = param.double() * decay
    step = lr * g
    return shrunk - step, shrunk, step, bad


@pytest.mark.parametrize("size", SIZES, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("pdt,gdt", COMBOS, ids=[f"p{p}-g{g}" for p, g in COMBOS])
def test_within_one_ulp_of_float64(pdt: str, gdt: str, size: int) -> None:
    kind = ("full", "tensors", "plain")[size % 3]
    opts = option_set(kind)
    pdtype = DTYPES[pdt]
    param = make_param(size, pdtype, seed=size + 5, specials=False)
    grad = make_grad(size, DTYPES[gdt], seed=size + 5, scale=grad_scale(kind), specials=True)
    exact, shrunk, step, bad = _float64_update(param, grad, opts)
    got = param.clone()
    found = torch.zeros(1)
    run_update(cpp_backend, got, grad, opts, found=found)

    assert torch.equal(int_bits(got)[bad], int_bits(param)[bad]), "skipped elements were written"
    assert found.item() == float(bool(bad.any()))
    ok = ~bad
    err = (got.double() - exact).abs()[ok]
    if pdtype == torch.float32:
        # The fp32 arithmetic bound: each of the five roundings of the reference's chain
        # (g * inv_scale, * clip_coef, lr * g, p * decay, the subtraction) adds at most
        # 2^-24 of its result. "1 ulp of max(|p|, |lr g|, |p_new|)" is not a bound of that
        # chain: the reference itself reaches ~1.8 ulp of that measure.
        bound = 2.0**-24 * (shrunk.abs() + 3 * step.abs() + exact.abs())[ok] * (1 + 2**-20)
        bound = torch.maximum(bound, torch.full_like(bound, 2.0**-149))  # subnormal floor
    else:
        bound = ulp(got.double()[ok], pdtype)  # 1 ulp of the param dtype at the result
    worst = (err / bound).max().item() if ok.any() else 0.0
    assert worst <= 1.0, f"error {worst:.3f} x bound"


# ---------------------------------------------------------------------------------------
# Stochastic rounding
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 7, 15, 16, 4097, 278011, 2**20 + 3], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("gdt", list(DTYPES))
@pytest.mark.parametrize("pdt", SR_DTYPES)
def test_stochastic_rounding_matches_reference(pdt: str, gdt: str, size: int) -> None:
    param = make_param(size, DTYPES[pdt], seed=size, specials=True)
    grad = make_grad(size, DTYPES[gdt], seed=size, scale=1024.0, specials=True)
    for seed in (0, 12345, 2**63 + 2**40 + 17):
        (got, want), (f_got, f_want) = cpp_and_reference(
            param, grad, option_set("full"), sr=True, seed=seed
        )
        assert_same_bits(got, want)
        assert torch.equal(f_got, f_want)


@pytest.mark.parametrize("size", [15, 4097, 2**20 + 3], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("pdt", SR_DTYPES)
def test_stochastic_rounding_seed_step_matches_reference(pdt: str, size: int) -> None:
    # The per-step value is XORed into the seed's high half: the same bits as that seed.
    param = make_param(size, DTYPES[pdt], seed=size, specials=True)
    for gdt in (pdt, "fp32"):  # the same-dtype vector loops and the mixed ones
        grad = make_grad(size, DTYPES[gdt], seed=size, scale=1024.0, specials=True)
        for step in (0, 5, 2**31 + 7, -3, 2**40 + 9):
            seed_step = torch.tensor([step], dtype=torch.int64)
            opts = option_set("full")
            (got, want), _ = cpp_and_reference(
                param, grad, opts, sr=True, seed=99, seed_step=seed_step
            )
            assert_same_bits(got, want)
            folded, _ = cpp_and_reference(
                param, grad, opts, sr=True, seed=99 ^ ((step % 2**32) << 32)
            )
            assert_same_bits(got, folded[0])


def test_stochastic_rounding_ignored_for_fp32() -> None:
    param = make_param(4099, torch.float32, seed=1, specials=False)
    grad = make_grad(4099, torch.float32, seed=1, scale=1.0, specials=False)
    a, b = param.clone(), param.clone()
    run_update(cpp_backend, a, grad, option_set("plain"), sr=True, seed=5)
    run_update(cpp_backend, b, grad, option_set("plain"), sr=False)
    assert_same_bits(a, b)


@pytest.mark.parametrize("pdt", SR_DTYPES)
def test_stochastic_rounding_differs_from_nearest(pdt: str) -> None:
    # About half the results lie on the other side of their nearest neighbour.
    param = make_param(4099, DTYPES[pdt], seed=1, specials=False)
    grad = make_grad(4099, DTYPES[pdt], seed=1, scale=1.0, specials=False)
    a, b = param.clone(), param.clone()
    run_update(cpp_backend, a, grad, option_set("plain"), sr=True, seed=5)
    run_update(cpp_backend, b, grad, option_set("plain"), sr=False)
    differ = (int_bits(a) != int_bits(b)).float().mean().item()
    assert 0.2 < differ < 0.6, differ


@pytest.mark.parametrize(
    "pdt,below",
    # 1 - 1e-3 * 0.3 lies between two neighbours of each dtype (2^-8 and 2^-11 apart below 1).
    [("bf16", 1.0 - 2**-8), ("fp16", 1.0 - 2**-11)],
)
def test_stochastic_rounding_is_unbiased_and_seeded(pdt: str, below: float) -> None:
    n = 2**20
    param = torch.ones(n, dtype=DTYPES[pdt])
    grad = torch.full((n,), 0.3, dtype=torch.float32)
    opts = option_set("plain") | dict(lr=1e-3)
    exact = 1.0 - as_f32(as_f32(1e-3) * as_f32(0.3))
    # Each element rounds down with probability q = (1 - exact) / spacing: the mean's standard
    # error is spacing * sqrt(q (1 - q) / n). Held to 6 of them plus the rule's quantisation
    # (16 random bits for bf16, 13 for fp16: a bias of at most 2^-13 of a spacing), below a
    # bias of 2^-8 of a spacing (what rounding with 8 random bits can give), for both dtypes.
    spacing = 1.0 - below
    q = (1.0 - exact) / spacing
    bound = 6 * spacing * math.sqrt(q * (1 - q) / n) + spacing * 2**-13
    assert bound < spacing * 2**-8
    runs = []
    for seed in (1, 2):
        p = param.clone()
        run_update(cpp_backend, p, grad, opts, sr=True, seed=seed)
        assert set(p.unique().float().tolist()) == {below, 1.0}
        runs.append(p)
        assert abs(p.double().mean().item() - exact) < bound
    assert not torch.equal(runs[0], runs[1])
    again = param.clone()
    run_update(cpp_backend, again, grad, opts, sr=True, seed=1)
    assert torch.equal(again, runs[0])


def test_fp16_stochastic_rounding_is_unbiased_below_the_normal_range() -> None:
    # 0 - 1 * g = 2.3 units of fp16's subnormal spacing 2^-24: 2 or 3 units, 2.3 on average
    # (the rule's bias is at most 2^-17 of a unit), and the same at 2^-14 - 0.3 units, where
    # rounding up reaches the smallest normal.
    n = 2**20
    for exact, outcomes in (
        (2.3 * 2**-24, {2 * 2**-24, 3 * 2**-24}),
        (2**-14 - 0.3 * 2**-24, {2**-14 - 2**-24, 2**-14}),
    ):
        value = as_f32(exact)
        grad = torch.full((n,), -value, dtype=torch.float32)
        p = torch.zeros(n, dtype=torch.float16)
        run_update(cpp_backend, p, grad, option_set("plain") | dict(lr=1.0), sr=True, seed=3)
        assert set(p.unique().double().tolist()) == outcomes
        assert abs(p.double().mean().item() - value) < 2e-3 * 2**-24  # ~4 standard errors


# ---------------------------------------------------------------------------------------
# fp16 stochastic rounding at the edges of fp16's range (subnormals, 2^-14, 65504, inf,
# nan, -0.0), in the first vector trip, a middle one, one with a non-finite gradient and
# the tail (support/fp16_edges.py); test_cpu_dispatch.py runs these at every CPU level.
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("gdt", ["same", "fp32"])
@pytest.mark.parametrize("pdt", SR_DTYPES)
def test_stochastic_rounding_edge_values_match_reference(pdt: str, gdt: str) -> None:
    check_edge_values_match_reference(pdt, gdt)


def test_fp16_stochastic_rounding_of_any_fp32_value_matches_reference() -> None:
    param, grad, opts = fp16_any_value_case(2**20 + 3, seed=4)
    (got, want), _ = cpp_and_reference(param, grad, opts, sr=True, seed=17)
    assert_same_bits(got, want)
    assert got.isinf().any() and (got.abs() < TINY16).any() and (got.abs() > TINY16).any()


@pytest.mark.parametrize("pdt", SR_DTYPES)
def test_stochastic_rounding_skip_if_writes_nothing(pdt: str) -> None:
    check_skip_if_writes_nothing(pdt)


# ---------------------------------------------------------------------------------------
# found_inf / skip_if
# ---------------------------------------------------------------------------------------


def _finite_case(dtype=torch.bfloat16, n=4099):
    return (
        make_param(n, dtype, seed=2, specials=False),
        make_grad(n, dtype, seed=2, scale=1.0, specials=False),
    )


def test_found_inf_set_and_bad_elements_kept() -> None:
    param, grad = _finite_case()
    grad[10] = INF
    grad[4000] = NAN
    p = param.clone()
    found = torch.zeros(1)
    run_update(cpp_backend, p, grad, option_set("plain"), found=found)
    assert found.item() == 1.0
    assert int_bits(p)[10] == int_bits(param)[10] and int_bits(p)[4000] == int_bits(param)[4000]
    changed = int_bits(p) != int_bits(param)
    assert changed.sum() > 3000  # the finite elements were updated


def test_found_inf_never_reset() -> None:
    param, grad = _finite_case()
    found = torch.ones(1)
    run_update(cpp_backend, param, grad, option_set("plain"), found=found)
    assert found.item() == 1.0
    found = torch.zeros(1)
    run_update(cpp_backend, param, grad, option_set("plain"), found=found)
    assert found.item() == 0.0


def test_overflow_after_unscale_counts_as_non_finite() -> None:
    param, grad = _finite_case(torch.float32)
    grad[5] = 3e38
    p = param.clone()
    found = torch.zeros(1)
    run_update(cpp_backend, p, grad, option_set("plain") | dict(inv_scale=4.0), found=found)
    assert found.item() == 1.0
    assert int_bits(p)[5] == int_bits(param)[5]


@pytest.mark.parametrize("flag", [1.0, -3.0, NAN])
def test_skip_if_writes_nothing(flag: float) -> None:
    param, grad = _finite_case()
    grad[3] = INF
    p = param.clone()
    found = torch.zeros(1)
    run_update(cpp_backend, p, grad, option_set("full"), found=found, skip=torch.tensor([flag]))
    assert torch.equal(int_bits(p), int_bits(param))
    assert found.item() == 0.0


def test_skip_if_zero_updates() -> None:
    param, grad = _finite_case()
    (got, want), _ = cpp_and_reference(param, grad, option_set("full"), with_skip=True)
    assert_same_bits(got, want)
    assert not torch.equal(int_bits(got), int_bits(param))


def test_skip_if_aliasing_found_inf() -> None:
    # The GradScaler pattern: one flag both read (skip) and written (found).
    param, grad = _finite_case()
    bad_grad = grad.clone()
    bad_grad[0] = INF
    flag = torch.zeros(1)
    first = param.clone()
    run_update(cpp_backend, first, bad_grad, option_set("plain"), found=flag, skip=flag)
    assert flag.item() == 1.0
    assert not torch.equal(int_bits(first), int_bits(param))  # read 0 before writing 1
    second = first.clone()
    run_update(cpp_backend, second, grad, option_set("plain"), found=flag, skip=flag)
    assert torch.equal(int_bits(second), int_bits(first))


def test_found_inf_none_is_fine() -> None:
    param, grad = _finite_case(torch.float16)
    grad[1] = NAN
    (got, want), _ = cpp_and_reference(param, grad, option_set("plain"))
    p = param.clone()
    run_update(cpp_backend, p, grad, option_set("plain"))
    assert_same_bits(p, want)


# ---------------------------------------------------------------------------------------
# Other properties
# ---------------------------------------------------------------------------------------


def _at_one_and_two_threads(run: Callable[[], object]) -> list:
    """`run()` with 1, then 2 threads (the previous count restored after); both results."""
    threads = torch.get_num_threads()
    results = []
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            results.append(run())
    finally:
        torch.set_num_threads(threads)
    return results


def test_independent_of_thread_count() -> None:
    param = make_param(2**20 + 3, torch.bfloat16, seed=9, specials=True)
    grad = make_grad(2**20 + 3, torch.float32, seed=9, scale=1024.0, specials=True)

    def update() -> torch.Tensor:
        p = param.clone()
        run_update(cpp_backend, p, grad, option_set("full"), sr=True, seed=3)
        return p

    first, second = _at_one_and_two_threads(update)
    assert torch.equal(int_bits(first), int_bits(second))


def test_bumps_version_counter() -> None:
    param, grad = _finite_case()
    before = param._version
    run_update(cpp_backend, param, grad, option_set("plain"))
    assert param._version > before


def test_empty_tensor() -> None:
    param = torch.empty(0, dtype=torch.bfloat16)
    run_update(cpp_backend, param, torch.empty(0), option_set("full"), found=torch.zeros(1))
    sumsq = torch.zeros(1)
    cpp_backend.grad_sumsq_(torch.empty(0), None, sumsq, None)
    assert sumsq.item() == 0.0


def test_cuda_unavailable_has_reason() -> None:
    if torch.version.cuda is not None and torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert not cpp_backend.is_available("cuda")
    assert cpp_backend.unavailable_reason("cuda")
    assert cpp_backend.unavailable_reason("cpu") == ""


# ---------------------------------------------------------------------------------------
# Gradient sum of squares
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", SIZES, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("gdt", list(DTYPES))
def test_grad_sumsq_vs_float64(gdt: str, size: int) -> None:
    grad = make_grad(size, DTYPES[gdt], seed=size, scale=1024.0, specials=False)
    inv_t = torch.tensor([1 / 1024])  # the effective value of the former pair 1/512 * [0.5]
    inv = as_f32(1 / 1024)
    g32 = grad.float() * inv
    exact = 1.25 + (g32.double() ** 2).sum().item()
    sumsq = torch.tensor([1.25])
    found = torch.zeros(1)
    cpp_backend.grad_sumsq_(grad, inv_t, sumsq, found)
    # Accumulated in double; only the final fp32 rounding remains.
    assert math.isclose(sumsq.item(), exact, rel_tol=2**-23)
    assert found.item() == 0.0
    ref_sumsq = torch.tensor([1.25])
    reference.grad_sumsq_(grad, inv_t, ref_sumsq, None)
    # The reference also accumulates in float64: the same two fp32 roundings bound it.
    assert math.isclose(ref_sumsq.item(), exact, rel_tol=2**-23)


@pytest.mark.parametrize("gdt", list(DTYPES))
def test_grad_sumsq_non_finite(gdt: str) -> None:
    grad = make_grad(100_003, DTYPES[gdt], seed=4, scale=1.0, specials=False)
    grad[77_777] = INF
    sumsq, found = torch.zeros(1), torch.zeros(1)
    cpp_backend.grad_sumsq_(grad, None, sumsq, found)
    assert found.item() == 1.0 and sumsq.item() == INF


def test_grad_sumsq_independent_of_thread_count() -> None:
    grad = make_grad(2**20 + 3, torch.float32, seed=5, scale=1.0, specials=False)

    def sumsq() -> float:
        s = torch.zeros(1)
        cpp_backend.grad_sumsq_(grad, None, s, None)
        return s.item()

    first, second = _at_one_and_two_threads(sumsq)
    assert first == second


# ---------------------------------------------------------------------------------------
# Gradient accumulation (tests/ops/test_grad_accumulate.py: against the float64 model)
# ---------------------------------------------------------------------------------------


def _same_sum(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a, b) or bool(a.isnan().all() and b.isnan().all())


@pytest.mark.parametrize("size", SIZES, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("bdt,gdt", COMBOS, ids=[f"b{b}-g{g}" for b, g in COMBOS])
def test_grad_accumulate_matches_reference_bitwise(bdt: str, gdt: str, size: int) -> None:
    # inf/nan gradients (odd sizes) and subnormal buffer values among the elements; each
    # variant: nearest and stochastic rounding, adding and the first micro-batch's pass.
    buffer = make_param(size, DTYPES[bdt], seed=size, specials=True)
    grad = make_grad(size, DTYPES[gdt], seed=size, scale=4.0, specials=size % 2 == 1)
    inv = torch.tensor([0.375])
    step = torch.tensor([2**32 + 3], dtype=torch.int64)
    for first in (False, True):
        for sr in roundings(bdt):
            (got, want), (s_got, s_want), (f_got, f_want) = accumulate_both(
                cpp_backend, buffer, grad, first=first, inv_scale=inv, sr=sr, seed=size,
                seed_step=step,
            )  # fmt: skip
            assert_same_stored(got, want)
            assert torch.equal(f_got, f_want)
            # The sum of squares is grad_sumsq_'s of the stored buffer, in its order.
            again = torch.tensor([0.75])
            cpp_backend.grad_sumsq_(got, inv, again, None)
            assert _same_sum(s_got, again)
            if f_want.item() == 0.0:  # the reference's float64 dot: two fp32 roundings apart
                bound = sumsq_rel_bound("cpp", size)
                assert math.isclose(s_got.item(), s_want.item(), rel_tol=2 * bound)
            else:
                assert not s_got.isfinite().item()


def test_grad_accumulate_first_does_not_read_the_buffer() -> None:
    grad = make_grad(4099, torch.float32, seed=3, scale=1.0, specials=False)
    for dtype in DTYPES.values():
        dirty = torch.full((4099,), float("nan")).to(dtype)
        (got, want), (s_got, _), (f_got, _) = accumulate_both(cpp_backend, dirty, grad, first=True)
        assert_same_stored(got, want)
        assert f_got.item() == 0.0 and s_got.isfinite().item()


def test_grad_accumulate_unaligned_views() -> None:
    # Views 1 and 3 elements into their storage: no vector loop may assume alignment.
    n = 4099
    base_b = make_param(n + 8, torch.bfloat16, seed=1, specials=False)
    base_g = make_grad(n + 8, torch.float16, seed=1, scale=1.0, specials=False)
    for sr in (False, True):
        (got, want), (s_got, s_want), _ = accumulate_both(
            cpp_backend, base_b[1 : n + 1], base_g[3 : n + 3], sr=sr, seed=9
        )
        assert_same_stored(got, want)
        assert math.isclose(s_got.item(), s_want.item(), rel_tol=2 * sumsq_rel_bound("cpp", n))


def test_grad_accumulate_independent_of_thread_count() -> None:
    buffer = make_param(2**20 + 3, torch.bfloat16, seed=9, specials=False)
    grad = make_grad(2**20 + 3, torch.bfloat16, seed=9, scale=1.0, specials=False)

    def accumulate() -> tuple[torch.Tensor, torch.Tensor]:
        out, sumsq = buffer.clone(), torch.zeros(1)
        cpp_backend.grad_accumulate_(out, grad, False, None, sumsq, None, True, 3, None, 0)
        return int_bits(out), sumsq

    (b1, s1), (b2, s2) = _at_one_and_two_threads(accumulate)
    assert torch.equal(b1, b2) and torch.equal(s1, s2)


def test_grad_accumulate_bumps_versions_and_empty() -> None:
    buffer, grad = _finite_case()
    sumsq, found = torch.zeros(1), torch.zeros(1)
    before = (buffer._version, sumsq._version)
    cpp_backend.grad_accumulate_(buffer, grad, False, None, sumsq, found, False, 0, None, 0)
    assert buffer._version > before[0] and sumsq._version > before[1]
    sumsq = torch.tensor([2.0])
    empty = torch.empty(0, dtype=torch.bfloat16)
    cpp_backend.grad_accumulate_(empty, torch.empty(0), False, None, sumsq, found, True, 1, None, 0)
    assert sumsq.item() == 2.0


# ---------------------------------------------------------------------------------------
# The portable fp16 conversions of lomo_math.h (used where F16C is absent and for tails)
# ---------------------------------------------------------------------------------------

_SWEEP = r"""
#include "lomo_math.h"
#include <cstdio>
#include <cstring>
int main() {
  unsigned long bad_up = 0, bad_down = 0;
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint16_t hb = static_cast<uint16_t>(h);
    _Float16 x;
    memcpy(&x, &hb, 2);
    const float want = static_cast<float>(x), got = lomo::fp16_to_f32_portable(hb);
    const bool both_nan = want != want && got != got;
    if (lomo::bits_of(want) != lomo::bits_of(got) && !both_nan) ++bad_up;
  }
  uint64_t u = 0;
  do {  // every fp32 bit pattern
    const float f = lomo::float_of(static_cast<uint32_t>(u));
    const _Float16 r = static_cast<_Float16>(f);
    uint16_t want;
    memcpy(&want, &r, 2);
    if (want != lomo::f32_to_fp16_portable(f)) ++bad_down;
  } while (++u < (1ull << 32));
  printf("%lu %lu\n", bad_up, bad_down);
  return 0;
}
"""


def _sweep_mismatches(tmp_path: Path, source: str, *flags: str) -> list[str]:
    """Builds and runs a sweep program over lomo_math.h; its printed mismatch counts. Skips
    where no C++ compiler with _Float16 support is at hand."""
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler on PATH")
    src, exe = tmp_path / "sweep.cpp", tmp_path / "sweep"
    src.write_text(source)
    command = [cxx, "-std=c++17", "-O2", "-march=native", *flags, f"-I{CSRC}", str(src)]
    build = subprocess.run([*command, "-o", str(exe)], capture_output=True, text=True)
    if build.returncode != 0:
        pytest.skip(f"compiler without _Float16 support: {build.stderr[-300:]}")
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True, timeout=600)
    return out.stdout.split()


def test_portable_fp16_conversions_exhaustive(tmp_path: Path) -> None:
    assert _sweep_mismatches(tmp_path, _SWEEP) == ["0", "0"]


# The fp16 stochastic rounding of lomo_math.h against core.rounding.fp16_stochastic transcribed
# (fp32 operations and floor as torch does them, then the exact cast), for every fp32 bit
# pattern: the integer form every kernel stores (f32_to_fp16_sr) and the fp32 value on the
# grid the F16C loops convert (fp16_sr_value). 16 random bits per pattern from its hash; the
# extremes 0 and 0xFFFF on every eighth pattern.
_SWEEP_SR = r"""
#include "lomo_math.h"
#include <cmath>
#include <cstdio>
#include <cstring>
// core.rounding.fp16_stochastic transcribed: fp32 operations and floor as torch does them, then
// the exact cast (nearest even) of the result.
static uint16_t spec(float v, uint32_t r) {
  const uint32_t bits = lomo::bits_of(v), sign = bits & 0x80000000u, mag = bits & 0x7FFFFFFFu;
  float out;
  if (mag > 0x477FE000u) {
    out = v;
  } else if (mag < 0x38800000u) {
    const float q = std::fabs(v) * 16777216.0f;
    const float whole = std::floor(q);
    const float scaled = (q - whole) * 131072.0f;
    const long frac17 = static_cast<long>(std::floor(scaled));
    const long tie = (std::floor(scaled) == scaled && (r & 1u)) ? 1 : 0;
    const float up = (2 * static_cast<long>(r) + 1 + frac17 - tie) >= 131072 ? 1.0f : 0.0f;
    out = lomo::float_of(lomo::bits_of((whole + up) * 5.9604644775390625e-8f) | sign);
  } else {
    out = lomo::float_of(((mag + (r >> 3)) & ~0x1FFFu) | sign);
  }
  const _Float16 h = static_cast<_Float16>(out);
  uint16_t hb;
  memcpy(&hb, &h, 2);
  return hb;
}
static bool same(uint16_t a, uint16_t b) {
  const bool nan_a = (a & 0x7FFF) > 0x7C00, nan_b = (b & 0x7FFF) > 0x7C00;
  return a == b || (nan_a && nan_b);
}
int main() {
  unsigned long bad_bits = 0, bad_value = 0;
  uint64_t u = 0;
  do {  // every fp32 bit pattern, with 16 random bits from its hash; the extremes 0 and
        // 0xFFFF on every eighth pattern
    const uint32_t x = static_cast<uint32_t>(u);
    const float f = lomo::float_of(x);
    uint32_t r = lomo::mix32(x) >> 16;
    if ((x & 7u) == 0) r = (x & 8u) ? 0xFFFFu : 0u;
    const uint16_t want = spec(f, r);
    if (!same(lomo::f32_to_fp16_sr(f, r), want)) ++bad_bits;
    const _Float16 h = static_cast<_Float16>(lomo::fp16_sr_value(f, r));
    uint16_t hb;
    memcpy(&hb, &h, 2);
    if (!same(hb, want)) ++bad_value;
  } while (++u < (1ull << 32));
  printf("%lu %lu\n", bad_bits, bad_value);
  return 0;
}
"""


def test_fp16_stochastic_rounding_exhaustive(tmp_path: Path) -> None:
    assert _sweep_mismatches(tmp_path, _SWEEP_SR, "-ffp-contract=off") == ["0", "0"]


# ---------------------------------------------------------------------------------------
# The 8-bit blockwise buffer (core/int8_blocks.py; support/int8_compare.py)
# ---------------------------------------------------------------------------------------


def _int8_cases(size: int) -> list[tuple[int, bool, bool]]:
    """(offset, first, stochastic) of a size: every combination up to two blocks; above, each
    offset adding stochastically and a first pass to nearest; at the largest size (~0.5 s a
    reference call) two of those."""
    if size <= 2 * INT8_BLOCK:
        return [(o, f, s) for o in INT8_OFFSETS for f in (False, True) for s in (False, True)]
    if size < 100_000:
        return [(o, f, not f) for o in INT8_OFFSETS for f in (False, True)]
    return [(300, False, True), (2**32 + 5, True, False)]


@pytest.mark.parametrize("size", INT8_SIZES, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("gdt", list(DTYPES))
def test_grad_accumulate_int8_matches_reference_bitwise(gdt: str, size: int) -> None:
    # Codes and scales bit for bit (blocks from fp32's subnormals to 2^120, ties, the scale
    # rule's boundary, zero and nan blocks in the buffer added to), the flag equal, the sum of
    # squares within the summation bound of the reference's float64 dot.
    inv = torch.tensor([SUMSQ_INV[DTYPES[gdt]]])
    step = torch.tensor([2**32 + 3], dtype=torch.int64)
    for k, (offset, first, sr) in enumerate(_int8_cases(size)):
        codes, scales = make_int8_buffer(size, offset, seed=size, dtype=DTYPES[gdt])
        grad = make_int8_grad(size, DTYPES[gdt], offset, seed=size + k)
        c, s, (s_got, s_want), (f_got, f_want) = accumulate_int8_both(
            cpp_backend, codes, scales, grad, offset, first=first, inv_scale=inv, sr=sr,
            seed=size + k, seed_step=step,
        )  # fmt: skip
        assert_same_buffer(c, s)
        assert torch.equal(f_got, f_want)
        if f_want.item() == 0.0:
            bound = sumsq_rel_bound("cpp", size)
            assert math.isclose(s_got.item(), s_want.item(), rel_tol=2 * bound)
        else:
            assert not s_got.isfinite().item() and not s_want.isfinite().item()


@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("special", ["inf", "-inf", "nan", "overflow"])
@pytest.mark.parametrize("gdt", list(DTYPES))
def test_grad_accumulate_int8_non_finite_matches_reference(
    gdt: str, special: str, where: str
) -> None:
    # An inf/nan gradient: its block stores codes 0 and a nan scale, the others as usual, the
    # flag set and the sum non-finite. "overflow": the dtype's largest value, whose stored
    # value times the inverse scale (2^113) passes fp32: flagged, its block kept finite.
    n, offset = 4097, 300
    codes = torch.empty(n, dtype=torch.int8)
    scales = torch.empty(blocks_of(offset, n))
    clean = make_grad(n, torch.float32, seed=5, scale=1.0, specials=False)
    reference.grad_accumulate_int8_(codes, scales, clean, offset, True, None, None, None,
                                    False, 0, None)  # fmt: skip
    grad = make_grad(n, DTYPES[gdt], seed=6, scale=1.0, specials=False)
    index = {"first": 0, "middle": 2 * INT8_BLOCK + 17, "last": n - 1}[where]
    value = {"inf": INF, "-inf": -INF, "nan": NAN}.get(special, torch.finfo(DTYPES[gdt]).max)
    grad[index] = value
    inv = torch.tensor([2.0**113])
    for first in (False, True):
        c, s, (s_got, _), (f_got, f_want) = accumulate_int8_both(
            cpp_backend, codes, scales, grad, offset, first=first, inv_scale=inv, sr=True, seed=3
        )
        assert_same_buffer(c, s)
        assert f_got.item() == f_want.item() == 1.0
        assert not s_got.isfinite().item()
        block = (offset % INT8_BLOCK + index) // INT8_BLOCK
        assert s[0].isnan().sum().item() == (special != "overflow")
        assert s[0][block].isnan().item() == (special != "overflow")


@pytest.mark.parametrize("size", INT8_SIZES, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("pdt", list(DTYPES))
def test_lomo_update_int8_matches_reference_bitwise(pdt: str, size: int) -> None:
    # The update's option sets over the offsets, bf16 and fp16 also stochastically (the
    # whole parameter's bits at offset + j); the buffer's nan block keeps its elements and
    # sets found_inf.
    offsets = INT8_OFFSETS if size < 100_000 else [300, 2**32 + 5]
    for k, offset in enumerate(offsets):
        kind = ("plain", "full", "tensors")[k % 3]
        codes, scales = make_int8_buffer(size, offset, seed=size)
        param = make_param(size, DTYPES[pdt], seed=size + k, specials=True)
        for sr in roundings(pdt):
            (got, want), (f_got, f_want) = update_int8_both(
                cpp_backend, param, codes, scales, offset, option_set(kind), sr=sr,
                seed=size + k, seed_step=torch.tensor([k], dtype=torch.int64),
            )  # fmt: skip
            assert_same_bits(got, want)
            assert torch.equal(f_got, f_want)


@pytest.mark.parametrize("pdt", list(DTYPES))
def test_lomo_update_int8_option_subsets_and_skip(pdt: str) -> None:
    # Each option on or neutral (the dense update's 16 vector loops), and a set skip_if: then
    # nothing is written and nothing flagged.
    n, offset = 4099, 2**32 + 5
    codes, scales = make_int8_buffer(n, offset, seed=1)
    param = make_param(n, DTYPES[pdt], seed=1, specials=True)
    for bits in OPTION_SUBSETS:
        for sr in roundings(pdt):
            (got, want), (f_got, f_want) = update_int8_both(
                cpp_backend, param, codes, scales, offset, option_subset(bits), sr=sr, seed=bits
            )
            assert_same_bits(got, want)
            assert f_got.item() == f_want.item() == 1.0  # the nan block
    for flag in (1.0, NAN):
        (got, _), (found, _) = update_int8_both(
            cpp_backend, param, codes, scales, offset, option_set("full"), skip=flag
        )
        assert torch.equal(int_bits(got), int_bits(param)) and found.item() == 0.0


@pytest.mark.parametrize("odt", list(DTYPES))
def test_int8_dequantize_matches_reference(odt: str) -> None:
    for size in INT8_SIZES:
        for offset in INT8_OFFSETS[:: 1 if size < 100_000 else 3]:
            codes, scales = make_int8_buffer(size, offset, seed=size)
            got, want = dequantize_both(cpp_backend, DTYPES[odt], codes, scales, offset)
            assert_same_values(got, want)


def test_int8_ops_independent_of_thread_count() -> None:
    # The accumulation's chunks are whole blocks at fixed places: codes, scales and the sum
    # of squares (finite: the buffer's nan block made a zero one) bit for bit at 1 and 2
    # threads, and the update from the result.
    n, offset = 2**20 + 3, 300
    codes, scales = make_int8_buffer(n, offset, seed=9)
    scales[-1] = 0.0
    grad = make_int8_grad(n, torch.bfloat16, offset, seed=9)
    param = make_param(n, torch.bfloat16, seed=9, specials=False)
    inv = torch.tensor([SUMSQ_INV[torch.bfloat16]])

    def run() -> tuple[torch.Tensor, ...]:
        c, s, sumsq = codes.clone(), scales.clone(), torch.tensor([0.5])
        cpp_backend.grad_accumulate_int8_(c, s, grad, offset, False, inv, sumsq, None, True, 3,
                                          None)  # fmt: skip
        p = param.clone()
        run_update(Int8Grad(cpp_backend, c, s, offset), p, None, option_set("full"), sr=True)
        return c, s.view(torch.int32), sumsq, int_bits(p)

    first, second = _at_one_and_two_threads(run)
    assert first[2].isfinite().item()
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_int8_ops_bump_versions_and_empty() -> None:
    n, offset = 4097, 1
    codes, scales = make_int8_buffer(n, offset, seed=2)
    grad = make_int8_grad(n, torch.float32, offset, seed=2)
    sumsq, found = torch.zeros(1), torch.zeros(1)
    before = (codes._version, scales._version, sumsq._version, found._version)
    cpp_backend.grad_accumulate_int8_(codes, scales, grad, offset, False, None, sumsq, found,
                                      False, 0, None)  # fmt: skip
    after = (codes._version, scales._version, sumsq._version, found._version)
    assert all(b < a for b, a in zip(before, after, strict=True))  # the nan block raised found
    param, out = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n)
    before = (param._version, out._version)
    cpp_backend.lomo_update_int8_(param, codes, scales, offset, torch.tensor([0.1]), None, None,
                                  None, 0.0, None, None, False, 0, None)  # fmt: skip
    cpp_backend.int8_dequantize_(out, codes, scales, offset)
    assert param._version > before[0] and out._version > before[1]
    # Empty: no scales, nothing added or flagged.
    none8, no_scales = torch.empty(0, dtype=torch.int8), torch.empty(0)
    sumsq, found = torch.tensor([2.0]), torch.zeros(1)
    cpp_backend.grad_accumulate_int8_(none8, no_scales, torch.empty(0), 5, False, None, sumsq,
                                      found, True, 1, None)  # fmt: skip
    cpp_backend.lomo_update_int8_(torch.empty(0, dtype=torch.bfloat16), none8, no_scales, 5,
                                  torch.tensor([0.1]), None, None, None, 0.0, found, None, True,
                                  1, None)  # fmt: skip
    cpp_backend.int8_dequantize_(torch.empty(0), none8, no_scales, 5)
    assert sumsq.item() == 2.0 and found.item() == 0.0


def test_int8_binding_refuses_bad_buffers() -> None:
    # The binding's own checks (the public functions check first): codes' dtype and size, the
    # scales' count for the offset, a negative offset.
    grad, out = torch.zeros(300), torch.zeros(300)
    codes, scales = torch.zeros(300, dtype=torch.int8), torch.zeros(2)
    cases = {
        "codes must be int8": (codes.to(torch.int16), scales, 0),
        "codes must have 300": (codes[:299], scales, 0),
        "scales must be fp32 with 3": (codes, scales, 250),
        "offset must be >= 0": (codes, scales, -1),
    }
    for message, (c, s, offset) in cases.items():
        with pytest.raises(RuntimeError, match=message):
            cpp_backend.grad_accumulate_int8_(c, s, grad, offset, True, None, None, None, False,
                                              0, None)  # fmt: skip
        with pytest.raises(RuntimeError, match=message):
            cpp_backend.int8_dequantize_(out, c, s, offset)
