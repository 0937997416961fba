"""LOMO updates whose stochastically rounded results sit at the edges of fp16's range
(subnormals, 2^-14, 65504, inf, nan, -0.0), in the first vector trip, a middle one, one with a
non-finite gradient and the tail, and the checks that a backend stores the reference's bits
there."""

from __future__ import annotations

import math

import torch

from lomo_kernels.core.rounding import random_bits16, rounding_key
from lomo_kernels.ops.lomo import cpp_backend as cpp_backend
from lomo_kernels.ops.lomo import reference
from support.lomo_bitwise import (
    DTYPES,
    INF,
    NAN,
    assert_same_bits,
    cpp_and_reference,
    int_bits,
    make_grad,
    make_param,
    option_set,
    run_update,
)

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


def edge_spots(count: int) -> list[int]:
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
    param = make_param(EDGE_SIZE, dtype, seed=31, specials=False)
    if gdt == "fp32":
        grad = make_grad(EDGE_SIZE, torch.float32, seed=31, scale=1e-3, specials=False)
        opts = option_set("plain") | dict(lr=1.0)
        pairs = fp16_edge_pairs_fp32()
    else:
        grad = make_grad(EDGE_SIZE, DTYPES[gdt], seed=31, scale=1.0, specials=False)
        opts = option_set("plain") | dict(lr=EDGE_LR16)
        pairs = FP16_EDGE_PAIRS
    p_vals = torch.tensor([p for p, _ in pairs], dtype=torch.float32).to(dtype)
    g_vals = torch.tensor([g for _, g in pairs], dtype=torch.float32).to(grad.dtype)
    for start in edge_spots(len(pairs)):
        param[start : start + len(pairs)] = p_vals
        grad[start : start + len(pairs)] = g_vals
    bad = EDGE_SPOTS["bad trip"] + len(pairs) // 2
    grad[bad], grad[bad + 1] = INF, NAN
    return param, grad, opts


def fp16_any_value_case(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(fp16 zeros, fp32 grad of random finite bit patterns, options) whose update 0 - 1 * g
    is -g exactly: every fp32 exponent, so the subnormal and overflow paths as often as the
    normal one."""
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**31), 2**31, (n,), generator=gen, dtype=torch.int64)
    grad = bits.to(torch.int32).view(torch.float32).clone()
    grad[~torch.isfinite(grad)] = 0.0
    return torch.zeros(n, dtype=torch.float16), grad, option_set("plain") | dict(lr=1.0)


def fp16_subnormal_tie_case(
    n: int, seed: int, seed_step: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, dict, torch.Tensor]:
    """(fp16 zeros, fp32 grad, options, expected): an update 0 - 1 * g = -g whose every
    element is a tie of fp16's subnormal stochastic rounding with its own write-back bits r:
    |g| * 2^24 = w + 1 - (2 r + 1) / 2^17 (w uniform in [0, 126]: exact in fp32's 24 bits),
    so the rounding rounds up for even r (w + 1 units of 2^-24) and down for odd (w)."""
    index = torch.arange(n, dtype=torch.int64)
    r = random_bits16(index, rounding_key(seed, seed_step))
    w = torch.randint(0, 127, (n,), generator=torch.Generator().manual_seed(n))
    units = (w + 1).double() - (2 * r + 1).double() * 2.0**-17
    grad = (units * 2.0**-24).float()
    expected = (-(w + 1 - r % 2).double() * 2.0**-24).to(torch.float16)
    return torch.zeros(n, dtype=torch.float16), grad, option_set("plain") | dict(lr=1.0), expected


def check_subnormal_ties_match_reference(module) -> None:
    """`module`'s fp16 write-back of `fp16_subnormal_tie_case` as the reference's, both the
    tie rule's result, with and without a per-step value."""
    for seed, step in ((3, None), (2**62 + 5, torch.tensor([77], dtype=torch.int64))):
        param, grad, opts, expected = fp16_subnormal_tie_case(4099, seed, step)
        for m in (module, reference):
            p = param.clone()
            run_update(m, p, grad, opts, sr=True, seed=seed, seed_step=step)
            assert_same_bits(p, expected)


def check_edge_values_match_reference(pdt: str, gdt: str) -> None:
    """The C++ backend's bits at fp16's edges, seeded with and without a per-step value, and
    with nearest rounding (the cast the overflow path falls back to). `gdt` "same": `pdt`."""
    gdt = pdt if gdt == "same" else gdt
    param, grad, opts = fp16_edge_case(pdt, gdt)
    for seed, step in ((0, None), (2**62 + 5, torch.tensor([77], dtype=torch.int64))):
        (got, want), (f_got, f_want) = cpp_and_reference(
            param, grad, opts, sr=True, seed=seed, seed_step=step
        )
        assert_same_bits(got, want)
        assert f_got.item() == f_want.item() == 1.0
    (got, want), _ = cpp_and_reference(param, grad, opts)
    assert_same_bits(got, want)


def check_skip_if_writes_nothing(pdt: str) -> None:
    """A set skip_if: the stochastically rounding C++ update writes and flags nothing."""
    param, grad, opts = fp16_edge_case(pdt, pdt)
    p, found = param.clone(), torch.zeros(1)
    step = torch.tensor([3], dtype=torch.int64)
    run_update(
        cpp_backend, p, grad, opts, found=found, skip=torch.ones(1), sr=True, seed=1, seed_step=step
    )
    assert torch.equal(int_bits(p), int_bits(param))
    assert found.item() == 0.0
