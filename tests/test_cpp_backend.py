"""C++ CPU backend against the reference backend (bit for bit) and float64 math (1 ulp).

Also the cases of stochastic rounding (bf16 and fp16 parameters: fp16's edge values, the
AdaLomo write-back passes) that test_cpu_dispatch.py runs at every CPU level and
test_cuda.py on a GPU.

The first run JIT-builds the extension (about a minute); later runs load it from the cache.
The backend functions take their arguments positionally (`lomo_reference.lomo_update_` order),
the runtime scalars lr, inv_scale and clip_coef as 1-element fp32 tensors (None: 1).
"""

from __future__ import annotations

import math
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from lomo_kernels.kernels.cpp import lomo as cpp_backend
from lomo_kernels.ops import adalomo_reference
from lomo_kernels.ops import lomo_reference as reference
from lomo_kernels.ops.adalomo import adalomo_workspace, init_adalomo_state
from lomo_kernels.ops.adalomo_workspace import NUM_SLOTS, P_SUMSQ, R_SUM

CSRC = Path(__file__).resolve().parent.parent / "csrc"
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
COMBOS = [(p, g) for p in DTYPES for g in DTYPES]
SIZES = [1, 7, 15, 16, 4097, 278011, 2**20 + 3]
MANTISSA_BITS = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}
INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
INF, NAN = float("inf"), float("nan")


@pytest.fixture(scope="module", autouse=True)
def built_extension() -> None:
    # A failed build is a test failure here, not a skip: the reason says what broke.
    assert cpp_backend.is_available("cpu"), cpp_backend.unavailable_reason("cpu")


def _options(kind: str) -> dict:
    """Option sets: no-ops, and two sets of values with every option on.

    lr, inv_scale and clip_coef are the values of the runtime scalars (None: absent, as the
    public functions pass a factor of exactly 1); `_run` hands them over as device tensors.
    "tensors" holds the effective values of the former float/tensor pairs (0.5 * 3e-2,
    2 * 1/4096, 1 * 0.6).
    """
    if kind == "plain":
        return dict(
            lr=1e-2,
            inv_scale=None,
            clip_value=None,
            clip_coef=None,
            weight_decay=0.0,
        )
    if kind == "full":
        return dict(
            lr=2e-2,
            inv_scale=1 / 1024,
            clip_value=1.5,
            clip_coef=0.75,
            weight_decay=0.1,
        )
    if kind == "tensors":
        return dict(
            lr=1.5e-2,
            inv_scale=1 / 2048,
            clip_value=2.0,
            clip_coef=0.6,
            weight_decay=0.05,
        )
    raise ValueError(kind)


def _scalar(value: float | None) -> torch.Tensor | None:
    """A runtime scalar as the backends take it: a 1-element fp32 tensor, or None."""
    return None if value is None else torch.tensor([value], dtype=torch.float32)


def _grad_scale(kind: str) -> float:
    # Gradients arrive multiplied by the loss scale that inv_scale undoes.
    return {"plain": 1.0, "full": 1024.0, "tensors": 2048.0}[kind]


def _make_param(n: int, dtype: torch.dtype, seed: int, specials: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    tiny = torch.finfo(dtype).tiny
    fixed = [0.0, -0.0, tiny / 4, -tiny / 2, tiny, 1.0, -2.0]
    if specials:
        fixed += [NAN, INF, -INF]
    for i, v in enumerate(fixed):  # odd positions; the grads' specials sit at even ones
        if 2 * i + 1 < n:
            p[2 * i + 1] = v
    return p.to(dtype)


def _make_grad(n: int, dtype: torch.dtype, seed: int, scale: float, specials: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 1)
    g = torch.randn(n, generator=gen) * scale
    if specials and n >= 8:
        g[2], g[4], g[6] = INF, -INF, NAN
        g[n // 2] = INF  # a vector trip past the first (its offset keys stochastic rounding)
        g[n - 1] = NAN
    return g.to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(INT_VIEW[t.dtype])


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-identical; for fp16/fp32 a nan only has to be a nan (torch's payloads vary)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    nan_got, nan_want = got.isnan(), want.isnan()
    assert torch.equal(nan_got, nan_want), "nan positions differ"
    if got.dtype == torch.bfloat16:  # the bf16 nan rule is specified in core/rounding.py
        mismatch = _bits(got) != _bits(want)
    else:
        mismatch = (_bits(got) != _bits(want)) & ~nan_got
    count = int(mismatch.sum())
    if count:
        i = int(mismatch.nonzero()[0])
        raise AssertionError(f"{count} elements differ, first at {i}: {got[i]} vs {want[i]}")


def _run(
    module, param, grad, opts, *, found=None, skip=None, sr=False, seed=0, seed_step=None
) -> None:
    module.lomo_update_(
        param,
        grad,
        _scalar(opts["lr"]),
        _scalar(opts["inv_scale"]),
        opts["clip_value"],
        _scalar(opts["clip_coef"]),
        opts["weight_decay"],
        found,
        skip,
        sr,
        seed,
        seed_step,
    )


def _both(param, grad, opts, *, sr=False, seed=0, seed_step=None, with_skip=False):
    """Runs the C++ and reference updates on copies; returns (params, found_inf flags)."""
    outs, flags = [], []
    for module in (cpp_backend, reference):
        p = param.clone()
        found = torch.zeros(1)
        skip = torch.zeros(1) if with_skip else None
        _run(module, p, grad, opts, found=found, skip=skip, sr=sr, seed=seed, seed_step=seed_step)
        outs.append(p)
        flags.append(found)
    return outs, flags


# ---------------------------------------------------------------------------------------
# Bit-exactness against the reference backend
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", SIZES, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("pdt,gdt", COMBOS, ids=[f"p{p}-g{g}" for p, g in COMBOS])
def test_matches_reference_bitwise(pdt: str, gdt: str, size: int) -> None:
    kind = ("plain", "full", "tensors")[size % 3]
    param = _make_param(size, DTYPES[pdt], seed=size, specials=True)
    grad = _make_grad(size, DTYPES[gdt], seed=size, scale=_grad_scale(kind), specials=True)
    (got, want), (f_got, f_want) = _both(param, grad, _options(kind), with_skip=True)
    assert_same_bits(got, want)
    assert torch.equal(f_got, f_want)


@pytest.mark.parametrize("kind", ["plain", "full", "tensors"])
@pytest.mark.parametrize("pdt,gdt", COMBOS, ids=[f"p{p}-g{g}" for p, g in COMBOS])
def test_option_sets_match_reference(pdt: str, gdt: str, kind: str) -> None:
    n = 50_021
    param = _make_param(n, DTYPES[pdt], seed=7, specials=True)
    grad = _make_grad(n, DTYPES[gdt], seed=7, scale=_grad_scale(kind), specials=True)
    (got, want), (f_got, f_want) = _both(param, grad, _options(kind))
    assert_same_bits(got, want)
    assert f_got.item() == f_want.item() == 1.0


@pytest.mark.parametrize("pdt,gdt", COMBOS, ids=[f"p{p}-g{g}" for p, g in COMBOS])
def test_unaligned_views_match_reference(pdt: str, gdt: str) -> None:
    # Views at odd storage offsets, updated in place: odd starts for the paired bf16 loop and
    # the F16C tiles; the elements around the views must stay untouched.
    n = 2**18 + 5
    pbuf = _make_param(n + 3, DTYPES[pdt], seed=3, specials=True)
    grad = _make_grad(n + 3, DTYPES[gdt], seed=3, scale=1024.0, specials=True)[3 : n + 3]
    buffers = []
    for module in (cpp_backend, reference):
        buf = pbuf.clone()
        _run(module, buf[1 : n + 1], grad, _options("full"), found=torch.zeros(1))
        buffers.append(buf)
    assert_same_bits(buffers[0], buffers[1])


OPTION_SUBSETS = list(range(16))  # bits: unscale, clip, weight decay, clip_coef


def _subset_options(bits: int) -> dict:
    """Each option on or neutral: the CPU kernel compiles neutral options out (16 loops)."""
    return dict(
        lr=2e-2,
        inv_scale=1 / 1024 if bits & 1 else None,
        clip_value=0.75 if bits & 2 else None,
        clip_coef=0.6 if bits & 8 else None,
        weight_decay=0.1 if bits & 4 else 0.0,
    )


@pytest.mark.parametrize("bits", OPTION_SUBSETS, ids=lambda b: f"options{b:04b}")
@pytest.mark.parametrize("pdt", ["fp32", "bf16", "fp16"])
def test_every_option_subset_matches_reference(pdt: str, bits: int) -> None:
    # Same-dtype pairs take the vector loops; sizes leave a tail after whole vectors, and
    # the specials (inf/nan grads, subnormal params and results) sit in the first vectors.
    dtype = DTYPES[pdt]
    for n in (4099, 64 * 1024 + 37):
        param = _make_param(n, dtype, seed=bits, specials=True)
        grad = _make_grad(n, dtype, seed=bits, scale=1024.0 if bits & 1 else 1.0, specials=True)
        (got, want), (f_got, f_want) = _both(param, grad, _subset_options(bits))
        assert_same_bits(got, want)
        assert f_got.item() == f_want.item() == 1.0
        clean = _make_grad(n, dtype, seed=bits + 99, scale=1.0, specials=False)
        (got, want), (f_got, f_want) = _both(param, clean, _subset_options(bits))
        assert_same_bits(got, want)
        assert f_got.item() == f_want.item() == 0.0
        if dtype != torch.float32:  # the stochastic-rounding vector loops, same subsets
            step = torch.tensor([bits * 977], dtype=torch.int64)
            for g in (grad, clean):
                (got, want), _ = _both(param, g, _subset_options(bits), sr=True, seed=bits)
                assert_same_bits(got, want)
                (got, want), _ = _both(
                    param, g, _subset_options(bits), sr=True, seed=bits, seed_step=step
                )
                assert_same_bits(got, want)


@pytest.mark.parametrize("clip", [0.0, -0.5])
@pytest.mark.parametrize("pdt", ["fp32", "bf16"])
def test_zero_and_negative_clip_bounds_match_reference(pdt: str, clip: float) -> None:
    # The public op refuses clip_value <= 0; the backend still follows torch.clamp for it
    # (a negative bound leaves the vector loops' one-instruction clamp for the generic one).
    n = 4099
    param = _make_param(n, DTYPES[pdt], seed=5, specials=True)
    grad = _make_grad(n, DTYPES[pdt], seed=5, scale=1.0, specials=True)
    opts = _options("plain") | dict(clip_value=clip)
    (got, want), _ = _both(param, grad, opts)
    assert_same_bits(got, want)


def test_decay_scalar_paths_match_reference() -> None:
    # 1 - lr*wd is formed in fp32 from the device lr, whatever the lr: reproduced bit for bit,
    # including where it differs from the decay formed in double (lr = wd = 0.3).
    param = _make_param(10_007, torch.float32, seed=11, specials=False)
    grad = _make_grad(10_007, torch.float32, seed=11, scale=1.0, specials=False)
    for lr, wd in [(0.1, 0.3), (0.3, 0.3), (0.37 * 0.71, 0.013)]:
        opts = _options("plain") | dict(lr=lr, weight_decay=wd)
        (got, want), _ = _both(param, grad, opts)
        assert_same_bits(got, want)
        # The decay of the documented math: fp32(1 - fp32(fp32(lr) * fp32(wd))), then
        # p * decay - lr * g in fp32 operations.
        lr32 = torch.tensor(lr, dtype=torch.float32)
        decay32 = 1.0 - lr32 * torch.tensor(wd, dtype=torch.float32)
        assert_same_bits(got, param * decay32 - lr32 * grad)


# ---------------------------------------------------------------------------------------
# Error bound against float64 math
# ---------------------------------------------------------------------------------------


def _ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of `dtype` at |x| (x in float64); subnormal spacing below the normal range."""
    tiny = torch.finfo(dtype).tiny
    exponent = torch.floor(torch.log2(x.abs().clamp_min(tiny)))
    return torch.exp2(exponent - MANTISSA_BITS[dtype])


def _f32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()


def _float64_update(param, grad, opts):
    """The update in float64 from the fp32-rounded scalars the kernel sees.

    Returns (exact new value, p * decay, lr * g, skip mask of the kernel).
    """
    lr = _f32(opts["lr"])
    # 1 - lr * wd in fp32 from the fp32 lr (the product of two fp32 values is exact in double).
    decay = _f32(1.0 - _f32(lr * _f32(opts["weight_decay"])))
    inv = 1.0 if opts["inv_scale"] is None else _f32(opts["inv_scale"])
    coef = 1.0 if opts["clip_coef"] is None else _f32(opts["clip_coef"])
    bad = ~torch.isfinite(grad.float() * inv)  # the kernel tests the fp32 product
    g = grad.double() * inv
    if opts["clip_value"] is not None:
        clip = _f32(opts["clip_value"])
        g = g.clamp(-clip, clip)
    g = g * coef
    shrunk = param.double() * decay
    step = lr * g
    return shrunk - step, shrunk, step, bad


@pytest.mark.parametrize("size", SIZES, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("pdt,gdt", COMBOS, ids=[f"p{p}-g{g}" for p, g in COMBOS])
def test_within_one_ulp_of_float64(pdt: str, gdt: str, size: int) -> None:
    kind = ("full", "tensors", "plain")[size % 3]
    opts = _options(kind)
    pdtype = DTYPES[pdt]
    param = _make_param(size, pdtype, seed=size + 5, specials=False)
    grad = _make_grad(size, DTYPES[gdt], seed=size + 5, scale=_grad_scale(kind), specials=True)
    exact, shrunk, step, bad = _float64_update(param, grad, opts)
    got = param.clone()
    found = torch.zeros(1)
    _run(cpp_backend, got, grad, opts, found=found)

    assert torch.equal(_bits(got)[bad], _bits(param)[bad]), "skipped elements were written"
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
        bound = _ulp(got.double()[ok], pdtype)  # 1 ulp of the param dtype at the result
    worst = (err / bound).max().item() if ok.any() else 0.0
    assert worst <= 1.0, f"error {worst:.3f} x bound"


# ---------------------------------------------------------------------------------------
# Stochastic rounding
# ---------------------------------------------------------------------------------------


SR_DTYPES = ["bf16", "fp16"]  # the parameter dtypes stochastic rounding applies to


@pytest.mark.parametrize("size", [1, 7, 15, 16, 4097, 278011, 2**20 + 3], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("gdt", list(DTYPES))
@pytest.mark.parametrize("pdt", SR_DTYPES)
def test_stochastic_rounding_matches_reference(pdt: str, gdt: str, size: int) -> None:
    param = _make_param(size, DTYPES[pdt], seed=size, specials=True)
    grad = _make_grad(size, DTYPES[gdt], seed=size, scale=1024.0, specials=True)
    for seed in (0, 12345, 2**63 + 2**40 + 17):
        (got, want), (f_got, f_want) = _both(param, grad, _options("full"), sr=True, seed=seed)
        assert_same_bits(got, want)
        assert torch.equal(f_got, f_want)


@pytest.mark.parametrize("size", [15, 4097, 2**20 + 3], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("pdt", SR_DTYPES)
def test_stochastic_rounding_seed_step_matches_reference(pdt: str, size: int) -> None:
    # The per-step value is XORed into the seed's high half: the same bits as that seed.
    param = _make_param(size, DTYPES[pdt], seed=size, specials=True)
    for gdt in (pdt, "fp32"):  # the same-dtype vector loops and the mixed ones
        grad = _make_grad(size, DTYPES[gdt], seed=size, scale=1024.0, specials=True)
        for step in (0, 5, 2**31 + 7, -3, 2**40 + 9):
            seed_step = torch.tensor([step], dtype=torch.int64)
            opts = _options("full")
            (got, want), _ = _both(param, grad, opts, sr=True, seed=99, seed_step=seed_step)
            assert_same_bits(got, want)
            folded, _ = _both(param, grad, opts, sr=True, seed=99 ^ ((step % 2**32) << 32))
            assert_same_bits(got, folded[0])


def test_stochastic_rounding_ignored_for_fp32() -> None:
    param = _make_param(4099, torch.float32, seed=1, specials=False)
    grad = _make_grad(4099, torch.float32, seed=1, scale=1.0, specials=False)
    a, b = param.clone(), param.clone()
    _run(cpp_backend, a, grad, _options("plain"), sr=True, seed=5)
    _run(cpp_backend, b, grad, _options("plain"), sr=False)
    assert_same_bits(a, b)


@pytest.mark.parametrize("pdt", SR_DTYPES)
def test_stochastic_rounding_differs_from_nearest(pdt: str) -> None:
    # About half the results lie on the other side of their nearest neighbour.
    param = _make_param(4099, DTYPES[pdt], seed=1, specials=False)
    grad = _make_grad(4099, DTYPES[pdt], seed=1, scale=1.0, specials=False)
    a, b = param.clone(), param.clone()
    _run(cpp_backend, a, grad, _options("plain"), sr=True, seed=5)
    _run(cpp_backend, b, grad, _options("plain"), sr=False)
    differ = (_bits(a) != _bits(b)).float().mean().item()
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
    opts = _options("plain") | dict(lr=1e-3)
    exact = 1.0 - _f32(_f32(1e-3) * _f32(0.3))
    runs = []
    for seed in (1, 2):
        p = param.clone()
        _run(cpp_backend, p, grad, opts, sr=True, seed=seed)
        assert set(p.unique().float().tolist()) == {below, 1.0}
        runs.append(p)
        assert abs(p.double().mean().item() - exact) < 1e-5  # ~10 standard errors (bf16)
    assert not torch.equal(runs[0], runs[1])
    again = param.clone()
    _run(cpp_backend, again, grad, opts, sr=True, seed=1)
    assert torch.equal(again, runs[0])


def test_fp16_stochastic_rounding_is_unbiased_below_the_normal_range() -> None:
    # 0 - 1 * g = 2.3 units of fp16's subnormal spacing 2^-24: 2 or 3 units, 2.3 on average
    # (the rule's bias is below 2^-16 of a unit), and the same at 2^-14 - 0.3 units, where
    # rounding up reaches the smallest normal.
    n = 2**20
    for exact, outcomes in (
        (2.3 * 2**-24, {2 * 2**-24, 3 * 2**-24}),
        (2**-14 - 0.3 * 2**-24, {2**-14 - 2**-24, 2**-14}),
    ):
        value = _f32(exact)
        grad = torch.full((n,), -value, dtype=torch.float32)
        p = torch.zeros(n, dtype=torch.float16)
        _run(cpp_backend, p, grad, _options("plain") | dict(lr=1.0), sr=True, seed=3)
        assert set(p.unique().double().tolist()) == outcomes
        assert abs(p.double().mean().item() - value) < 2e-3 * 2**-24  # ~4 standard errors


# ---------------------------------------------------------------------------------------
# fp16 stochastic rounding at the edges of fp16's range (subnormals, 2^-14, 65504, inf,
# nan, -0.0), in the first vector trip, a middle one, one with a non-finite gradient and
# the tail; test_cpu_dispatch.py runs these at every CPU level.
# ---------------------------------------------------------------------------------------

TINY16 = 2.0**-14  # fp16's smallest normal
SUB16 = 2.0**-24  # fp16's subnormal spacing
# Updated fp32 values around fp16's boundaries: each is stored from 0 - 1 * grad (an fp32
# grad of minus the value), or, for inf and nan, from that parameter value and a zero grad.
FP16_EDGE_VALUES = [
    0.0,
    -0.0,
    1e-40,  # fp32 subnormal
    -3e-9,  # below half of fp16's smallest subnormal
    SUB16 * 0.3,
    SUB16,
    -SUB16 * 2.5,
    SUB16 * 511.75,
    -SUB16 * 1023.5,
    TINY16 * (1 - 2**-24),  # the largest fp32 value below 2^-14
    TINY16,
    -TINY16 * (1 + 2**-23),
    TINY16 * (1 + 2**-11 - 2**-20),
    1.0 + 2**-12,
    -3.14159,
    65472.5,
    65504.0,
    -65504.5,
    65519.99,
    65520.0,  # the nearest cast's first value that overflows
    -65535.0,
    65536.0,
    1e5,
    -3e38,
    float("inf"),
    float("-inf"),
    float("nan"),
]
# Parameter and gradient pairs of fp16 (or bf16) operands whose update p - 2^-11 * g (lr
# 2^-11, the other options neutral) lands near the same boundaries, off the fp16 grid: the
# same-dtype vector loops cannot take an fp32 gradient.
EDGE_LR16 = 2.0**-11
FP16_EDGE_PAIRS = [
    (0.0, 0.0),
    (-0.0, 0.0),
    (-0.0, SUB16),  # -2^-35
    (0.0, -SUB16 * 1000),
    (SUB16 * 3, 0.3 * 2**-13),
    (-SUB16 * 17, 0.7 * 2**-13),
    (SUB16 * 1023, -0.9 * 2**-13),
    (TINY16, SUB16 * 5),  # just below 2^-14
    (TINY16, -SUB16 * 5),  # just above
    (-TINY16, -SUB16 * 3),
    (TINY16 * (1 + 2**-10), 0.75),
    (1.0, 1.0),
    (-2.5, 3.0),
    (65504.0, -16384.0),  # 65512: back to 65504
    (65504.0, -32768.0),  # 65520: overflows
    (65504.0, -65504.0),
    (-65504.0, 1000.0),
    (65504.0, 1000.0),
    (60000.0, 0.1),
    (float("inf"), 0.0),
    (float("-inf"), 1.0),
    (float("nan"), 0.0),
]
EDGE_SIZE = 4096 + 255  # tails of 31 after the 32-element trips, 255 after 256-element tiles
EDGE_SPOTS = {"first": 0, "middle": 32 * 40 + 5, "bad trip": 32 * 90 + 3}


def _edge_spots(count: int) -> list[int]:
    """Where the edge groups start: the first trip, a middle one, one holding a non-finite
    gradient (its trip takes the element loop) and the last `count` elements (the tail)."""
    return [*EDGE_SPOTS.values(), EDGE_SIZE - count]


def fp16_edge_pairs_fp32() -> list[tuple[float, float]]:
    """(param, fp32 grad) pairs whose update 0 - 1 * g (or p - 0) is each FP16_EDGE_VALUES
    value: a finite value v from p = 0 and g = -v (-0.0 from p = -0.0, g = 0), inf and nan
    from the parameter (a non-finite gradient is never written)."""
    pairs = []
    for v in FP16_EDGE_VALUES:
        if not math.isfinite(v):
            pairs.append((v, 0.0))
        elif v == 0.0 and math.copysign(1.0, v) < 0:
            pairs.append((-0.0, 0.0))
        else:
            pairs.append((0.0, -v))
    return pairs


def fp16_edge_case(pdt: str, gdt: str) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(param, grad, options) of an update whose results sit at the fp16 edges above, the
    rest random, with an inf gradient in the "bad trip" group and a nan one after it."""
    dtype = DTYPES[pdt]
    param = _make_param(EDGE_SIZE, dtype, seed=31, specials=False)
    if gdt == "fp32":
        grad = _make_grad(EDGE_SIZE, torch.float32, seed=31, scale=1e-3, specials=False)
        opts = _options("plain") | dict(lr=1.0)
        pairs = fp16_edge_pairs_fp32()
    else:
        grad = _make_grad(EDGE_SIZE, DTYPES[gdt], seed=31, scale=1.0, specials=False)
        opts = _options("plain") | dict(lr=EDGE_LR16)
        pairs = FP16_EDGE_PAIRS
    p_vals = torch.tensor([p for p, _ in pairs], dtype=torch.float32).to(dtype)
    g_vals = torch.tensor([g for _, g in pairs], dtype=torch.float32).to(grad.dtype)
    for start in _edge_spots(len(pairs)):
        param[start : start + len(pairs)] = p_vals
        grad[start : start + len(pairs)] = g_vals
    bad = EDGE_SPOTS["bad trip"] + len(pairs) // 2
    grad[bad], grad[bad + 1] = INF, NAN
    return param, grad, opts


@pytest.mark.parametrize("gdt", ["same", "fp32"])
@pytest.mark.parametrize("pdt", SR_DTYPES)
def test_stochastic_rounding_edge_values_match_reference(pdt: str, gdt: str) -> None:
    gdt = pdt if gdt == "same" else gdt
    param, grad, opts = fp16_edge_case(pdt, gdt)
    for seed, step in ((0, None), (2**62 + 5, torch.tensor([77], dtype=torch.int64))):
        (got, want), (f_got, f_want) = _both(param, grad, opts, sr=True, seed=seed, seed_step=step)
        assert_same_bits(got, want)
        assert f_got.item() == f_want.item() == 1.0
    # Nearest rounding of the same values (the cast the overflow path falls back to).
    (got, want), _ = _both(param, grad, opts)
    assert_same_bits(got, want)


def fp16_any_value_case(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(fp16 zeros, fp32 grad of random finite bit patterns, options) whose update 0 - 1 * g
    is -g exactly: every fp32 exponent, so the subnormal and overflow paths as often as the
    normal one."""
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**31), 2**31, (n,), generator=gen, dtype=torch.int64)
    grad = bits.to(torch.int32).view(torch.float32).clone()
    grad[~torch.isfinite(grad)] = 0.0
    return torch.zeros(n, dtype=torch.float16), grad, _options("plain") | dict(lr=1.0)


def test_fp16_stochastic_rounding_of_any_fp32_value_matches_reference() -> None:
    param, grad, opts = fp16_any_value_case(2**20 + 3, seed=4)
    (got, want), _ = _both(param, grad, opts, sr=True, seed=17)
    assert_same_bits(got, want)
    assert got.isinf().any() and (got.abs() < TINY16).any() and (got.abs() > TINY16).any()


@pytest.mark.parametrize("pdt", SR_DTYPES)
def test_stochastic_rounding_skip_if_writes_nothing(pdt: str) -> None:
    param, grad, opts = fp16_edge_case(pdt, pdt)
    p, found = param.clone(), torch.zeros(1)
    step = torch.tensor([3], dtype=torch.int64)
    _run(
        cpp_backend, p, grad, opts, found=found, skip=torch.ones(1), sr=True, seed=1, seed_step=step
    )
    assert torch.equal(_bits(p), _bits(param))
    assert found.item() == 0.0


# ---------------------------------------------------------------------------------------
# AdaLomo's write-back passes (factored_apply_, vector_apply_) with stochastic rounding:
# cases for test_cpu_dispatch.py (every CPU level) and test_cuda.py. Given the same workspace
# and moments, a backend's pass and the reference store the same bits (their fp32 math
# agrees: correctly rounded sqrt and division, no contraction), so each is compared bit for
# bit; the passes before them are the reference's.
# ---------------------------------------------------------------------------------------

ADALOMO_SR_SHAPES = [(1,), (7,), (4097,), (278011,), (37, 1031), (1, 7), (2, 3, 7)]
ROUNDING_SEEDS = [(0, None), (2**62 + 3, torch.tensor([5], dtype=torch.int64))]
APPLY_OPTIONS = dict(eps1=1e-3, clip_threshold=0.8, weight_decay=0.1, clip_value=1.5)


def adalomo_scalars() -> dict[str, torch.Tensor]:
    return dict(
        lr=torch.tensor([0.05]),
        beta2=torch.tensor([0.5]),
        inv_scale=torch.tensor([0.5]),
        clip_coef=torch.tensor([0.37]),
    )


def prepared_write_back(shape, pdt: str, gdt: str):
    """(param, grad, state, workspace) ready for the write-back: the reference's passes A
    (A1), moments and B on a random parameter."""
    gen = torch.Generator().manual_seed(sum(shape))
    param = torch.randn(shape, generator=gen).to(DTYPES[pdt])
    grad = (torch.randn(shape, generator=gen) * 3).to(DTYPES[gdt])
    state, workspace = init_adalomo_state(param), adalomo_workspace(param)
    k, clip = adalomo_scalars(), APPLY_OPTIONS["clip_value"]
    if param.dim() >= 2:
        row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
        adalomo_reference.factored_stats_(
            grad, param, workspace, None, None, shape[-1], k["inv_scale"], clip
        )
        adalomo_reference.factored_moments_(row, col, workspace, k["beta2"], k["clip_coef"], 1e-30)
        adalomo_reference.factored_norm_(
            grad, row, col, workspace, k["inv_scale"], clip, k["clip_coef"]
        )
    else:
        adalomo_reference.vector_stats_(
            grad, param, state["exp_avg_sq"], workspace, None, None, k["beta2"], 1e-30,
            k["inv_scale"], clip, k["clip_coef"],
        )  # fmt: skip
    return param, grad, state, workspace


def adalomo_write_back(
    module, param, grad, state, workspace, *, sr, seed=0, seed_step=None, **hyper
):
    """`module`'s write-back pass (C or C1) on copies; returns (param, state). `hyper`
    overrides the scalars (lr, beta2, eps0, ...)."""
    param, workspace = param.clone(), workspace.clone()
    state = {key: value.clone() for key, value in state.items()}
    a = adalomo_scalars() | dict(eps0=1e-30) | APPLY_OPTIONS | hyper
    tail = (a["eps1"], a["clip_threshold"], a["weight_decay"], a["inv_scale"], a["clip_value"])
    tail += (a["clip_coef"], sr, seed, seed_step)
    if param.dim() >= 2:
        row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
        module.factored_apply_(param, grad, row, col, workspace, a["lr"], *tail)
    else:
        v = state["exp_avg_sq"]
        module.vector_apply_(param, grad, v, workspace, a["beta2"], a["eps0"], a["lr"], *tail)
    return param, state


def assert_same_write_back(got, want, any_nan: bool = False) -> None:
    """Parameter and state bit for bit; with `any_nan`, a nan only has to be a nan (one that
    fp32 arithmetic makes, such as inf * 0, has no specified sign: torch and the kernels may
    differ there, and bf16 keeps that sign)."""
    if any_nan:
        nan = got[0].isnan()
        assert torch.equal(nan, want[0].isnan()), "nan positions differ"
        got, want = (got[0].masked_fill(nan, 0.0), got[1]), (want[0].masked_fill(nan, 0.0), want[1])
    assert_same_bits(got[0], want[0])
    for key, value in want[1].items():
        if any_nan:
            assert torch.equal(got[1][key].isnan(), value.isnan()), key
            assert torch.equal(got[1][key].nan_to_num(0.0), value.nan_to_num(0.0)), key
        else:
            assert torch.equal(got[1][key].view(torch.int32), value.view(torch.int32)), key


def edge_write_back_case(pdt: str, gdt: str, shape):
    """(param, grad, state, workspace, hyper) of a write-back whose results sit at fp16's
    boundaries (FP16_EDGE_VALUES, FP16_EDGE_PAIRS), at the start, in a middle row segment,
    across a row boundary (factored) or the 32768-element chunks of the threads (1-D), and
    at the end; an inf and a nan gradient in the middle group.

    Moments of 1 and a synthesized workspace make every factor exact: r = c = rsqrt(1) = 1
    (factored), v_new = v * 1 + (g^2 + 0) * 0 = 1 (1-D, beta2 = 1; nan for the inf grad),
    lr_t = lr * rms(p) from P_SUMSQ, scale = lr_t (U_SUMSQ 0), decay = 1: the new value is
    p - lr_t * g, lr_t being 1 (fp32 grads) or 2^-11 (bf16/fp16 grads) as there."""
    dtype, numel = DTYPES[pdt], math.prod(shape)
    gen = torch.Generator().manual_seed(numel)
    param = torch.randn(numel, generator=gen).to(dtype)
    if gdt == "fp32":
        grad = torch.randn(numel, generator=gen) * 1e-3
        pairs, lr_t = fp16_edge_pairs_fp32(), 1.0
    else:
        grad = torch.randn(numel, generator=gen).to(DTYPES[gdt])
        pairs, lr_t = FP16_EDGE_PAIRS, EDGE_LR16
    p_vals = torch.tensor([p for p, _ in pairs]).to(dtype)
    g_vals = torch.tensor([g for _, g in pairs]).to(grad.dtype)
    count = len(pairs)
    boundary = shape[-1] if len(shape) >= 2 else 32_768
    middle = numel // 2 - 3
    for start in (0, middle, boundary - count // 2, numel - count):
        param[start : start + count] = p_vals
        grad[start : start + count] = g_vals
    grad[middle + 3], grad[middle + 4] = float("inf"), float("nan")
    param, grad = param.view(shape), grad.view(shape)
    state = {key: torch.ones_like(value) for key, value in init_adalomo_state(param).items()}
    workspace = adalomo_workspace(param)
    stats = workspace[workspace.numel() - NUM_SLOTS :]
    stats[P_SUMSQ] = numel * lr_t * lr_t  # rms(p) = lr_t, exactly
    stats[R_SUM] = state["exp_avg_sq_row"].numel() if len(shape) >= 2 else 0.0
    hyper = dict(
        lr=torch.tensor([1.0]), beta2=torch.tensor([1.0]), eps0=0.0, eps1=0.0,
        clip_threshold=1.0, weight_decay=0.0, inv_scale=None, clip_value=None, clip_coef=None,
    )  # fmt: skip
    return param, grad, state, workspace, hyper


# ---------------------------------------------------------------------------------------
# found_inf / skip_if
# ---------------------------------------------------------------------------------------


def _finite_case(dtype=torch.bfloat16, n=4099):
    return (
        _make_param(n, dtype, seed=2, specials=False),
        _make_grad(n, dtype, seed=2, scale=1.0, specials=False),
    )


def test_found_inf_set_and_bad_elements_kept() -> None:
    param, grad = _finite_case()
    grad[10] = INF
    grad[4000] = NAN
    p = param.clone()
    found = torch.zeros(1)
    _run(cpp_backend, p, grad, _options("plain"), found=found)
    assert found.item() == 1.0
    assert _bits(p)[10] == _bits(param)[10] and _bits(p)[4000] == _bits(param)[4000]
    changed = _bits(p) != _bits(param)
    assert changed.sum() > 3000  # the finite elements were updated


def test_found_inf_never_reset() -> None:
    param, grad = _finite_case()
    found = torch.ones(1)
    _run(cpp_backend, param, grad, _options("plain"), found=found)
    assert found.item() == 1.0
    found = torch.zeros(1)
    _run(cpp_backend, param, grad, _options("plain"), found=found)
    assert found.item() == 0.0


def test_overflow_after_unscale_counts_as_non_finite() -> None:
    param, grad = _finite_case(torch.float32)
    grad[5] = 3e38
    p = param.clone()
    found = torch.zeros(1)
    _run(cpp_backend, p, grad, _options("plain") | dict(inv_scale=4.0), found=found)
    assert found.item() == 1.0
    assert _bits(p)[5] == _bits(param)[5]


@pytest.mark.parametrize("flag", [1.0, -3.0, NAN])
def test_skip_if_writes_nothing(flag: float) -> None:
    param, grad = _finite_case()
    grad[3] = INF
    p = param.clone()
    found = torch.zeros(1)
    _run(cpp_backend, p, grad, _options("full"), found=found, skip=torch.tensor([flag]))
    assert torch.equal(_bits(p), _bits(param))
    assert found.item() == 0.0


def test_skip_if_zero_updates() -> None:
    param, grad = _finite_case()
    (got, want), _ = _both(param, grad, _options("full"), with_skip=True)
    assert_same_bits(got, want)
    assert not torch.equal(_bits(got), _bits(param))


def test_skip_if_aliasing_found_inf() -> None:
    # The GradScaler pattern: one flag both read (skip) and written (found).
    param, grad = _finite_case()
    bad_grad = grad.clone()
    bad_grad[0] = INF
    flag = torch.zeros(1)
    first = param.clone()
    _run(cpp_backend, first, bad_grad, _options("plain"), found=flag, skip=flag)
    assert flag.item() == 1.0
    assert not torch.equal(_bits(first), _bits(param))  # read 0 before writing 1
    second = first.clone()
    _run(cpp_backend, second, grad, _options("plain"), found=flag, skip=flag)
    assert torch.equal(_bits(second), _bits(first))


def test_found_inf_none_is_fine() -> None:
    param, grad = _finite_case(torch.float16)
    grad[1] = NAN
    (got, want), _ = _both(param, grad, _options("plain"))
    p = param.clone()
    _run(cpp_backend, p, grad, _options("plain"))
    assert_same_bits(p, want)


# ---------------------------------------------------------------------------------------
# Other properties
# ---------------------------------------------------------------------------------------


def test_independent_of_thread_count() -> None:
    param = _make_param(2**20 + 3, torch.bfloat16, seed=9, specials=True)
    grad = _make_grad(2**20 + 3, torch.float32, seed=9, scale=1024.0, specials=True)
    threads = torch.get_num_threads()
    results = []
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            p = param.clone()
            _run(cpp_backend, p, grad, _options("full"), sr=True, seed=3)
            results.append(p)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(_bits(results[0]), _bits(results[1]))


def test_bumps_version_counter() -> None:
    param, grad = _finite_case()
    before = param._version
    _run(cpp_backend, param, grad, _options("plain"))
    assert param._version > before


def test_empty_tensor() -> None:
    param = torch.empty(0, dtype=torch.bfloat16)
    _run(cpp_backend, param, torch.empty(0), _options("full"), found=torch.zeros(1))
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
    grad = _make_grad(size, DTYPES[gdt], seed=size, scale=1024.0, specials=False)
    inv_t = torch.tensor([1 / 1024])  # the effective value of the former pair 1/512 * [0.5]
    inv = _f32(1 / 1024)
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
    grad = _make_grad(100_003, DTYPES[gdt], seed=4, scale=1.0, specials=False)
    grad[77_777] = INF
    sumsq, found = torch.zeros(1), torch.zeros(1)
    cpp_backend.grad_sumsq_(grad, None, sumsq, found)
    assert found.item() == 1.0 and sumsq.item() == INF


def test_grad_sumsq_independent_of_thread_count() -> None:
    grad = _make_grad(2**20 + 3, torch.float32, seed=5, scale=1.0, specials=False)
    threads = torch.get_num_threads()
    sums = []
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            s = torch.zeros(1)
            cpp_backend.grad_sumsq_(grad, None, s, None)
            sums.append(s.item())
    finally:
        torch.set_num_threads(threads)
    assert sums[0] == sums[1]


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


def test_portable_fp16_conversions_exhaustive(tmp_path: Path) -> None:
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler on PATH")
    src = tmp_path / "sweep.cpp"
    src.write_text(_SWEEP)
    exe = tmp_path / "sweep"
    build = subprocess.run(
        [cxx, "-std=c++17", "-O2", "-march=native", f"-I{CSRC}", str(src), "-o", str(exe)],
        capture_output=True,
        text=True,
    )
    if build.returncode != 0:
        pytest.skip(f"compiler without _Float16 support: {build.stderr[-300:]}")
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True, timeout=600)
    assert out.stdout.split() == ["0", "0"], out.stdout


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
    const long frac16 = static_cast<long>(std::floor((q - whole) * 65536.0f));
    const float up = (static_cast<long>(r) + frac16) >= 65536 ? 1.0f : 0.0f;
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
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler on PATH")
    src = tmp_path / "sweep_sr.cpp"
    src.write_text(_SWEEP_SR)
    exe = tmp_path / "sweep_sr"
    flags = ["-std=c++17", "-O2", "-march=native", "-ffp-contract=off", f"-I{CSRC}"]
    build = subprocess.run([cxx, *flags, str(src), "-o", str(exe)], capture_output=True, text=True)
    if build.returncode != 0:
        pytest.skip(f"compiler without _Float16 support: {build.stderr[-300:]}")
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True, timeout=600)
    assert out.stdout.split() == ["0", "0"], out.stdout
