"""Triton backend under the Triton interpreter, against float64 math and the reference.

Triton-specific cases: the bulk/tail split around multiples of 16 and of the block size,
unaligned views, bit-identical bf16 rounding (nearest and stochastic) and fp16 stochastic
rounding, the device-side found_inf / skip_if flags, including the same tensor passed as
both, and the sum of squares. The backend functions take their arguments positionally
(`lomo_reference.lomo_update_` order), the runtime scalars lr, inv_scale and clip_coef as
1-element fp32 tensors (None: 1). The 8-bit blockwise buffer's accumulation, update and
dequantisation, bit for bit, on slices with partial first and last blocks. Last, the
stochastic rounding of the AdaLomo write-back passes (`adalomo_reference.factored_apply_`,
`vector_apply_`), bit for bit.
"""

import os

# Before triton is imported: triton.jit picks the interpreter when a function is decorated.
# An explicit TRITON_INTERPRET=0 (`make test-gpu`) is kept: this module then skips, and the
# compiled kernels are tested on CUDA tensors in test_cuda.py.
os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from support.dependencies import require  # noqa: E402
from support.float64 import sumsq_rel_bound  # noqa: E402
from support.fp16_edges import check_subnormal_ties_match_reference  # noqa: E402
from support.grad_accumulate import accumulate_both, assert_same_stored, roundings  # noqa: E402
from support.int8_compare import check_stochastic_ties  # noqa: E402

from lomo_kernels import ops
from lomo_kernels.core import rounding as _rounding  # noqa: E402
from lomo_kernels.core.int8_blocks import INT8_BLOCK, blocks_of  # noqa: E402
from lomo_kernels.kernels.triton import runtime  # noqa: E402
from lomo_kernels.ops.adalomo import reference as ada_reference  # noqa: E402
from lomo_kernels.ops.adalomo import triton_backend as triton_adalomo  # noqa: E402
from lomo_kernels.ops.adalomo.workspace import (  # noqa: E402
    NUM_SLOTS,
    P_SUMSQ,
    R_SUM,
    SKIP,
    U_SUMSQ,
    workspace_numel,
)
from lomo_kernels.ops.lomo import reference as reference  # noqa: E402
from lomo_kernels.ops.lomo import triton_backend as triton_backend  # noqa: E402
from lomo_kernels.ops.lomo.spec import GRAD_ACCUMULATE_INT8, LOMO_UPDATE  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ["TRITON_INTERPRET"] != "1",
    reason="interpreter tests: TRITON_INTERPRET=0 runs compiled kernels (test_cuda.py)",
)
if os.environ["TRITON_INTERPRET"] == "1" and not triton_backend.is_available():
    # Triton is a dependency and runs on any CPU under the interpreter: a failure, not a skip.
    pytest.fail(f"Triton backend unavailable: {triton_backend.unavailable_reason()}", pytrace=False)

require("lomo_kernels.kernels.triton.lomo_kernels")
BLOCK = triton_backend.BLOCK
SIZES = [1, 7, 15, 16, 17, 4097, 278011]
SMALL_SIZES = [1, 15, 17, 4097]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
INF = float("inf")
# The runtime scalars: device tensors in every backend call (inv_scale, clip_coef None = 1).
RUNTIME_SCALARS = ("lr", "inv_scale", "clip_coef")
# Positional order of the backends' lomo_update_ after param and grad.
ARG_ORDER = (
    "lr",
    "inv_scale",
    "clip_value",
    "clip_coef",
    "weight_decay",
    "found_inf",
    "skip_if",
    "stochastic_rounding",
    "seed",
    "seed_step",
    "offset",
)


def _options(**overrides: object) -> dict:
    options = dict(
        lr=1e-2,
        inv_scale=None,
        clip_value=None,
        clip_coef=None,
        weight_decay=0.0,
        found_inf=None,
        skip_if=None,
        stochastic_rounding=False,
        seed=0,
        seed_step=None,
        offset=0,
    )
    options.update(overrides)
    return options


# Every optional input given, with values that make each step change the result (the
# effective values of the former float/tensor pairs 2e-2 * 0.5, 0.25 * 3, 0.8 * 0.9).
FULL = dict(
    lr=[0.01],
    inv_scale=[0.75],
    clip_value=1.5,
    clip_coef=[0.72],
    weight_decay=0.1,
)


def _materialise(options: dict) -> dict:
    """Turns list-valued options and float runtime scalars into fresh 1-element fp32
    tensors."""
    out = {}
    for k, v in options.items():
        if isinstance(v, list):
            v = torch.tensor(v, dtype=torch.float32)
        elif k in RUNTIME_SCALARS and isinstance(v, float):
            v = torch.tensor([v], dtype=torch.float32)
        out[k] = v
    return out


def _args(options: dict) -> tuple:
    """The materialised options as the backends' positional arguments."""
    return tuple(options[k] for k in ARG_ORDER)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _inputs(
    n: int, param_dtype: torch.dtype, grad_dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    param = torch.randn(n, generator=gen).to(param_dtype)
    grad = (3 * torch.randn(n, generator=gen)).to(grad_dtype)
    return param, grad


def _both(
    param: torch.Tensor, grad: torch.Tensor, **options: object
) -> tuple[torch.Tensor, torch.Tensor, dict, dict]:
    """Runs Triton and reference on copies; returns both params and both option sets."""
    ours, theirs = param.clone(), param.clone()
    opts_ours, opts_theirs = _materialise(_options(**options)), _materialise(_options(**options))
    triton_backend.lomo_update_(ours, grad, *_args(opts_ours))
    reference.lomo_update_(theirs, grad, *_args(opts_theirs))
    return ours, theirs, opts_ours, opts_theirs


def _effective(options: dict, name: str) -> float:
    """The value of a runtime scalar in float64 (the decimal value, before fp32 rounding)."""
    value = options[name]
    if value is None:
        return 1.0
    if isinstance(value, list):
        return float(value[0])
    if isinstance(value, torch.Tensor):
        return float(value.reshape(-1)[0])
    return float(value)


def _expected_fp64(param: torch.Tensor, grad: torch.Tensor, options: dict) -> torch.Tensor:
    """The update in float64 (no rounding but the inputs'); non-finite g keeps the param."""
    lr = _effective(options, "lr")
    g = grad.double() * _effective(options, "inv_scale")
    bad = ~torch.isfinite(g)
    if options["clip_value"] is not None:
        g = g.clamp(-options["clip_value"], options["clip_value"])
    g = g * _effective(options, "clip_coef")
    p = param.double()
    return torch.where(bad, p, p * (1 - lr * options["weight_decay"]) - lr * g)


def _assert_close_to_fp64(
    out: torch.Tensor, param: torch.Tensor, grad: torch.Tensor, options: dict, ulps: float
) -> None:
    """|out - exact| <= ulps * ulp(exact) plus the error of a few fp32 roundings."""
    exact = _expected_fp64(param, grad, options)
    info = torch.finfo(out.dtype)
    step = (
        _effective(options, "lr")
        * _effective(options, "inv_scale")
        * _effective(options, "clip_coef")
        * grad.double().nan_to_num(posinf=0.0, neginf=0.0)
    )
    # fp32 rounds the effective scalars, g * inv_scale, * clip_coef, lr * g, p * decay, the
    # difference: a few units of 2**-24 of the magnitudes involved.
    fp32_slack = 8 * 2.0**-24 * (param.double().abs() + step.abs())
    bound = ulps * info.eps * exact.abs() + info.smallest_normal * info.eps + fp32_slack
    err = (out.double() - exact).abs()
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3e}"


# ----------------------------------------------------------------------------- bulk and tail


@pytest.mark.parametrize("n", SIZES)
def test_bf16_nearest_bit_identical_across_bulk_tail(n: int) -> None:
    param, grad = _inputs(n, torch.bfloat16, torch.bfloat16)
    ours, theirs, opts, _ = _both(param, grad, **FULL)
    assert torch.equal(_bits(ours), _bits(theirs))
    _assert_close_to_fp64(ours, param, grad, opts, ulps=0.5)


@pytest.mark.parametrize("n", [7, 17, 278011])
def test_bf16_stochastic_bit_identical_across_bulk_tail(n: int) -> None:
    param, grad = _inputs(n, torch.bfloat16, torch.bfloat16, seed=1)
    ours, theirs, opts, _ = _both(param, grad, **FULL, stochastic_rounding=True, seed=2**40 + 3)
    assert torch.equal(_bits(ours), _bits(theirs))
    _assert_close_to_fp64(ours, param, grad, opts, ulps=1.0)


@pytest.mark.parametrize("n", SMALL_SIZES)
@pytest.mark.parametrize(
    ("param_dtype", "grad_dtype"),
    [("fp32", "fp32"), ("fp16", "fp16"), ("bf16", "fp32"), ("fp32", "bf16"), ("fp16", "bf16")],
)
def test_dtype_combinations(n: int, param_dtype: str, grad_dtype: str) -> None:
    param, grad = _inputs(n, DTYPES[param_dtype], DTYPES[grad_dtype], seed=n)
    ours, theirs, opts, _ = _both(param, grad, **FULL)
    # The interpreter does not fuse multiply-adds, so even fp32 matches torch bit for bit.
    assert torch.equal(_bits(ours), _bits(theirs))
    _assert_close_to_fp64(ours, param, grad, opts, ulps=0.5)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_python_float_scalars(dtype: str) -> None:
    """Python-float scalars through the public op: converted once to fp32 device tensors,
    so the decay 1 - lr * weight_decay is formed in fp32 from the device lr by both.
    lr * weight_decay = 0.09: 1 - 0.09 rounds differently in double and in fp32."""
    param, grad = _inputs(4097, DTYPES[dtype], DTYPES[dtype])
    scalars = dict(lr=0.3, weight_decay=0.3, inv_scale=0.5, clip_value=2.0, clip_coef=0.7)
    ours, theirs = param.clone(), param.clone()
    ops.fused_sgd_update_(ours, grad, **scalars, backend="triton")
    ops.fused_sgd_update_(theirs, grad, **scalars, backend="torch")
    assert torch.equal(_bits(ours), _bits(theirs))
    # The same launch as the backend called directly with the converted tensors.
    direct, _, opts, _ = _both(param, grad, **scalars)
    assert torch.equal(_bits(ours), _bits(direct))
    _assert_close_to_fp64(ours, param, grad, opts, ulps=0.5)
    # The decay is the fp32 one: 1 - fp32(fp32(0.3) * 0.3) in fp32, not 1 - 0.09 in double.
    zero = torch.zeros_like(grad)
    decayed = param.clone()
    ops.fused_sgd_update_(decayed, zero, lr=0.3, weight_decay=0.3, backend="triton")
    lr32 = torch.tensor(0.3, dtype=torch.float32)
    decay32 = 1.0 - lr32 * torch.tensor(0.3, dtype=torch.float32)
    assert decay32.item() != torch.tensor(1.0 - 0.3 * 0.3, dtype=torch.float32).item()
    expected = (param.float() * decay32 - lr32 * zero.float()).to(param.dtype)
    assert torch.equal(_bits(decayed), _bits(expected))


def test_empty_parameter_is_a_no_op() -> None:
    found_inf = torch.zeros(1)
    triton_backend.lomo_update_(
        torch.empty(0), torch.empty(0), *_args(_materialise(_options(found_inf=found_inf)))
    )
    assert found_inf.item() == 0.0


# ----------------------------------------------------------------------------- unaligned


@pytest.mark.parametrize("n", [17, 4097])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_unaligned_views(n: int, dtype: str) -> None:
    """Parameter and gradient start at odd element offsets of bigger buffers."""
    param_buf, grad_buf = _inputs(n + 8, DTYPES[dtype], DTYPES[dtype], seed=5)
    param, grad = param_buf[1 : 1 + n], grad_buf[3 : 3 + n]
    assert param.data_ptr() % 16 != 0 and grad.data_ptr() % 16 != 0
    expected = param.clone()
    reference.lomo_update_(expected, grad, *_args(_materialise(_options(**FULL))))
    before = param_buf.clone()
    triton_backend.lomo_update_(param, grad, *_args(_materialise(_options(**FULL))))
    assert torch.equal(_bits(param), _bits(expected))
    # Nothing outside the view is written.
    assert torch.equal(_bits(param_buf[:1]), _bits(before[:1]))
    assert torch.equal(_bits(param_buf[1 + n :]), _bits(before[1 + n :]))


# ----------------------------------------------------------------------------- rounding


def test_bf16_rounding_of_special_patterns() -> None:
    """Ties to even, rounding up to inf, subnormals: p = 0 - 1 * (-v) is exactly v."""
    patterns = [
        0x3F808000,
        0x3F818000,
        0x3F807FFF,
        0x3F808001,
        0x7F7FFFFF,
        0xFF7FFFFF,
        0x7F7F8000,
        0x00000001,
        0x80008000,
        0x007FFFFF,
        0xBF80C000,
        0x4B7FFFFF,
    ]
    value = torch.tensor(patterns, dtype=torch.int64).to(torch.int32).view(torch.float32)
    zeros = torch.zeros(len(patterns), dtype=torch.bfloat16)
    ours, theirs, _, _ = _both(zeros, -value, lr=1.0)
    assert torch.equal(_bits(ours), _bits(theirs))
    assert torch.equal(_bits(ours).to(torch.int64) & 0xFFFF, _rounding.fp32_to_bf16_bits(value))
    ours, theirs, _, _ = _both(zeros, -value, lr=1.0, stochastic_rounding=True, seed=5)
    assert torch.equal(_bits(ours), _bits(theirs))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, inside the interpreter
@pytest.mark.parametrize("stochastic", [False, True])
def test_bf16_non_finite_parameters(stochastic: bool) -> None:
    """inf stays inf, NaN comes back quiet (payload kept), under both roundings."""
    bits = torch.tensor([0x7F80, 0xFF80, 0x7F81, 0xFFC1, 0x3F80], dtype=torch.int64)
    param = _rounding.bf16_from_bits(bits)
    ours, theirs, _, _ = _both(
        param, torch.zeros(5, dtype=torch.bfloat16), lr=0.1, stochastic_rounding=stochastic, seed=3
    )
    assert torch.equal(_bits(ours), _bits(theirs))
    assert (_bits(ours).to(torch.int64) & 0xFFFF).tolist() == [
        0x7F80,
        0xFF80,
        0x7FC1,
        0xFFC1,
        0x3F80,
    ]


@pytest.mark.parametrize("seed", [0, 12345, 2**63 + 17])
def test_stochastic_rounding_seed_handling(seed: int) -> None:
    """Same seed, same bits (also for keys >= 2**31, passed as int32 bits)."""
    param, grad = _inputs(4097, torch.bfloat16, torch.bfloat16, seed=3)
    ours, theirs, _, _ = _both(param, grad, lr=1e-3, stochastic_rounding=True, seed=seed)
    assert torch.equal(_bits(ours), _bits(theirs))
    again, _, _, _ = _both(param, grad, lr=1e-3, stochastic_rounding=True, seed=seed)
    assert torch.equal(_bits(ours), _bits(again))


def test_stochastic_rounding_keys_cover_both_int32_halves() -> None:
    keys = [_rounding.seed_key(s) for s in (0, 12345, 2**63 + 17)]
    assert any(k >= 2**31 for k in keys) and any(k < 2**31 for k in keys)


def _check_seed_step_from_device(dtype: torch.dtype, n: int, step: int, seed: int) -> None:
    """The per-step value read by the kernel: the reference's bits, which are those of the
    seed with the step's low 32 bits XORed into its high half."""
    param, grad = _inputs(n, dtype, dtype, seed=seed)
    seed_step = torch.tensor([step], dtype=torch.int64)
    ours, theirs, _, _ = _both(
        param, grad, **FULL, stochastic_rounding=True, seed=2**33 + 11, seed_step=seed_step
    )
    assert torch.equal(_bits(ours), _bits(theirs))
    folded = (2**33 + 11) ^ ((step & 0xFFFFFFFF) << 32)
    expected, _, _, _ = _both(param, grad, **FULL, stochastic_rounding=True, seed=folded)
    assert torch.equal(_bits(ours), _bits(expected))


@pytest.mark.parametrize("n", [17, 4097])
@pytest.mark.parametrize("step", [0, 5, 2**31 + 7, -3, 2**40 + 9])
def test_stochastic_rounding_seed_step_from_device(n: int, step: int) -> None:
    _check_seed_step_from_device(torch.bfloat16, n, step, seed=6)


def test_stochastic_rounding_depends_on_seed() -> None:
    param, grad = _inputs(4097, torch.bfloat16, torch.bfloat16, seed=4)
    a, _, _, _ = _both(param, grad, lr=1e-3, stochastic_rounding=True, seed=1)
    b, _, _, _ = _both(param, grad, lr=1e-3, stochastic_rounding=True, seed=2)
    assert not torch.equal(_bits(a), _bits(b))


# ----------------------------------------------------------------------------- fp16 stochastic

# fp32 bit patterns (magnitudes) around fp16's ranges, each also taken negative.
FP16_EDGE_PATTERNS = [
    0x00000001,  # fp32 subnormals: 0 or 2^-24, almost always 0
    0x007FFFFF,
    0x33000000,  # 2^-25, half of fp16's smallest subnormal 2^-24
    0x337FFFFF,  # just below 2^-24
    0x33800000,  # 2^-24, exact
    0x33C00000,  # 1.5 * 2^-24
    0x34A00001,  # just above 5 * 2^-24
    0x3800A3D7,  # a subnormal with many dropped bits
    0x387FC000,  # 1023 * 2^-24, the largest subnormal, exact
    0x387FE000,  # 1023.5 * 2^-24
    0x387FFFFF,  # just below 2^-14
    0x38800000,  # 2^-14, the smallest normal, exact
    0x38800001,  # just above it
    0x38801FFF,  # just below its successor
    0x3F800001,  # normal range: 1 + 2^-23
    0x3F801000,  # 1 + 2^-11 (half an ulp)
    0x3F801FFF,
    0x3FFFFFFF,  # just below 2, rounds to 2 or 2 - 2^-10
    0x477FDFFF,  # just below 65504: 65472 or 65504, never beyond
    0x477FE000,  # 65504, the largest finite, exact
    0x477FE001,  # beyond 65504: the nearest cast, 65504 ...
    0x477FEFFF,  # ... up to 65520 (excluded)
    0x477FF000,  # 65520: inf
    0x47800000,  # 65536
    0x49742400,  # 1e6
    0x5DDE0B6B,  # 2e18 (its square is finite: the 1-D AdaLomo pass squares it)
]


def _fp32_from_bits(patterns: list[int]) -> torch.Tensor:
    bits = torch.tensor(patterns, dtype=torch.int64)
    return torch.cat([bits, bits | 0x80000000]).to(torch.int32).view(torch.float32)


def _fp16_neighbours(value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp16 values just below and above each finite in-range fp32 `value` (equal when
    it is on the grid), as float64."""
    nearest = value.to(torch.float16)
    other = torch.where(
        nearest.double() > value.double(),
        torch.nextafter(nearest, torch.tensor(-INF, dtype=torch.float16)),
        torch.nextafter(nearest, torch.tensor(INF, dtype=torch.float16)),
    )
    other = torch.where(nearest.double() == value.double(), nearest, other)
    low = torch.minimum(nearest.double(), other.double())
    high = torch.maximum(nearest.double(), other.double())
    return low, high


def _check_fp16_stochastic(out: torch.Tensor, value: torch.Tensor) -> None:
    """Stochastic rounding's contract on each element: the fp16 neighbour below or above
    within fp16's range (sign and -0.0 kept), the nearest cast beyond 65504, non-finite
    values as they are."""
    beyond = value.abs() > 65504
    assert torch.equal(_bits(out[beyond]), _bits(value[beyond].to(torch.float16)))
    low, high = _fp16_neighbours(value[~beyond])
    got = out[~beyond].double()
    assert bool(((got == low) | (got == high)).all())
    assert torch.equal(torch.signbit(out), torch.signbit(value))


@pytest.mark.parametrize(
    ("n", "grad_dtype"),
    [(1, "fp16"), (7, "fp32"), (17, "fp16"), (4097, "fp32"), (278011, "fp16")],
)
def test_fp16_stochastic_bit_identical_across_bulk_tail(n: int, grad_dtype: str) -> None:
    param, grad = _inputs(n, torch.float16, DTYPES[grad_dtype], seed=11)
    ours, theirs, opts, _ = _both(param, grad, **FULL, stochastic_rounding=True, seed=2**40 + 3)
    assert torch.equal(_bits(ours), _bits(theirs))
    _assert_close_to_fp64(ours, param, grad, opts, ulps=1.0)
    if n >= 17:  # and not the nearest rounding
        nearest, _, _, _ = _both(param, grad, **FULL)
        assert not torch.equal(_bits(ours), _bits(nearest))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, inside the interpreter
@pytest.mark.parametrize("seed", [5, 2**63 + 17])
def test_fp16_stochastic_rounding_of_edge_values(seed: int) -> None:
    """p = 0 - 1 * (-v) is exactly v: subnormals, 2^-14, 65504 and beyond; inf, nan and -0.0
    parameters with a zero gradient (p = p * 1 - 0) keep their values and signs."""
    value = _fp32_from_bits(FP16_EDGE_PATTERNS)
    specials = torch.tensor([INF, -INF, float("nan"), -float("nan"), -0.0], dtype=torch.float16)
    param = torch.cat([torch.zeros(len(value), dtype=torch.float16), specials])
    grad = torch.cat([-value, torch.zeros(len(specials))])
    ours, theirs, _, _ = _both(param, grad, lr=1.0, stochastic_rounding=True, seed=seed)
    assert torch.equal(_bits(ours), _bits(theirs))
    _check_fp16_stochastic(ours[: len(value)], value)
    assert _bits(ours[len(value) :]).tolist() == _bits(specials).tolist()


def test_fp16_stochastic_rounding_is_unbiased() -> None:
    """4096 copies of a value a quarter of the way from one fp16 value to the next round
    up about a quarter of the time: normal range, subnormal range, next to 65504."""
    values = [1 + 2.0**-12, 3.25 * 2.0**-24, 65480.0, -(2.0**-14 + 2.0**-26)]
    value = torch.tensor(values).repeat_interleave(BLOCK)
    ours, theirs, _, _ = _both(
        torch.zeros(len(value), dtype=torch.float16), -value, lr=1.0, stochastic_rounding=True
    )
    assert torch.equal(_bits(ours), _bits(theirs))
    low, high = _fp16_neighbours(value)
    up = ((ours.double() - low) / (high - low)).view(len(values), BLOCK).mean(dim=1)
    magnitude_up = torch.where(torch.tensor(values) < 0, 1 - up, up)
    # 5 standard deviations of the mean of 4096 Bernoulli(1/4) draws.
    assert bool(((magnitude_up - 0.25).abs() < 5 * (0.25 * 0.75 / BLOCK) ** 0.5).all())


@pytest.mark.parametrize("step", [0, 2**31 + 7, -3])
def test_fp16_stochastic_rounding_seed_step_from_device(step: int) -> None:
    _check_seed_step_from_device(torch.float16, 4097, step, seed=12)


def test_fp16_stochastic_rounding_with_flags() -> None:
    """Non-finite gradients keep their elements (bulk and tail) and raise found_inf; a set
    skip_if writes nothing."""
    n = 2 * BLOCK + 5
    param, grad = _with_bad_grads(n, [3, n - 1], torch.float16)
    step = torch.tensor([9], dtype=torch.int64)
    sr = dict(stochastic_rounding=True, seed=77, seed_step=step)
    ours, theirs, opts, ref_opts = _both(param, grad, **FULL, **sr, found_inf=[0.0])
    assert torch.equal(_bits(ours), _bits(theirs))
    assert torch.equal(_bits(ours[[3, n - 1]]), _bits(param[[3, n - 1]]))
    assert opts["found_inf"].item() == ref_opts["found_inf"].item() == 1.0
    skipped, _, _, _ = _both(param, grad, **FULL, **sr, found_inf=[0.0], skip_if=[1.0])
    assert torch.equal(_bits(skipped), _bits(param))


def test_stochastic_rounding_launch_arguments() -> None:
    """bf16 and fp16 parameters launch the stochastic variant with the per-step seed; fp32
    stores the result exactly and launches the nearest one (as the references ignore it)."""
    step = torch.zeros(1, dtype=torch.int64)
    for dtype, stochastic in [
        (torch.bfloat16, True),
        (torch.float16, True),
        (torch.float32, False),
    ]:
        _, args = triton_backend.lomo_update_args(LOMO_UPDATE.Arguments(
            torch.zeros(33, dtype=dtype), torch.zeros(33), torch.ones(1), None, None, None,
            0.0, None, None, True, 2**63 + 17, step, 0,
        ))  # fmt: skip
        assert args["STOCHASTIC_ROUNDING"] is stochastic
        assert (args["seed_step_ptr"] is step) is stochastic
        assert all(-(2**31) <= args[k] < 2**31 for k in ("seed_lo", "seed_hi"))
        assert runtime.rounding_args(torch.zeros(1, dtype=dtype), True, 3)[0] is stochastic
    param, grad = _inputs(33, torch.float32, torch.float32)
    ours, _, _, _ = _both(param, grad, **FULL, stochastic_rounding=True, seed=3)
    nearest, _, _, _ = _both(param, grad, **FULL)
    assert torch.equal(_bits(ours), _bits(nearest))


# ----------------------------------------------------------------------------- flags


def _with_bad_grads(
    n: int, positions: list[int], dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    param, grad = _inputs(n, dtype, dtype, seed=9)
    for i, value in zip(positions, [INF, -INF, float("nan")] * len(positions), strict=False):
        grad[i] = value
    return param, grad


@pytest.mark.parametrize("n", [17, 3 * BLOCK + 5])
def test_non_finite_grad_keeps_element_and_sets_found_inf(n: int) -> None:
    # One bad element in the first program, one in the tail.
    param, grad = _with_bad_grads(n, [3, n - 1])
    ours, theirs, opts, ref_opts = _both(param, grad, **FULL, found_inf=[0.0])
    assert torch.equal(_bits(ours), _bits(theirs))
    assert torch.equal(_bits(ours[[3, n - 1]]), _bits(param[[3, n - 1]]))
    assert opts["found_inf"].item() == ref_opts["found_inf"].item() == 1.0


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, inside the interpreter
def test_overflow_after_unscaling_counts_as_non_finite() -> None:
    param, grad = _inputs(33, torch.float32, torch.float32)
    grad[5] = 3e38
    ours, theirs, opts, _ = _both(param, grad, inv_scale=10.0, found_inf=[0.0])
    assert torch.equal(_bits(ours), _bits(theirs))
    assert ours[5] == param[5] and opts["found_inf"].item() == 1.0


def test_finite_grads_leave_found_inf_alone() -> None:
    param, grad = _inputs(4097, torch.bfloat16, torch.bfloat16)
    for initial in (0.0, 1.0):
        _, _, opts, ref_opts = _both(param, grad, found_inf=[initial])
        assert opts["found_inf"].item() == ref_opts["found_inf"].item() == initial


def test_skip_if_writes_nothing() -> None:
    param, grad = _with_bad_grads(3 * BLOCK + 5, [10])
    ours, _, opts, ref_opts = _both(param, grad, **FULL, found_inf=[0.0], skip_if=[1.0])
    assert torch.equal(_bits(ours), _bits(param))
    assert opts["found_inf"].item() == ref_opts["found_inf"].item() == 0.0


def test_skip_if_zero_updates() -> None:
    param, grad = _inputs(4097, torch.bfloat16, torch.bfloat16)
    ours, theirs, _, _ = _both(param, grad, **FULL, skip_if=[0.0])
    assert torch.equal(_bits(ours), _bits(theirs))
    assert not torch.equal(_bits(ours), _bits(param))


def test_same_tensor_as_found_inf_and_skip_if() -> None:
    """A flag raised by the first program must not make later programs of the same launch
    skip: skip_if is read as it was when the call was made, as in the reference."""
    n = 3 * BLOCK + 5
    param, grad = _with_bad_grads(n, [10])
    flag = torch.zeros(1)
    ours = param.clone()
    triton_backend.lomo_update_(
        ours, grad, *_args(_materialise(_options(**FULL)) | dict(found_inf=flag, skip_if=flag))
    )
    ref_flag = torch.zeros(1)
    theirs = param.clone()
    reference.lomo_update_(
        theirs,
        grad,
        *_args(_materialise(_options(**FULL)) | dict(found_inf=ref_flag, skip_if=ref_flag)),
    )
    assert torch.equal(_bits(ours), _bits(theirs))
    assert not torch.equal(_bits(ours[BLOCK:]), _bits(param[BLOCK:]))
    assert flag.item() == ref_flag.item() == 1.0
    # A second call with the raised flag skips everything.
    again = ours.clone()
    triton_backend.lomo_update_(
        again, grad, *_args(_materialise(_options(**FULL)) | dict(found_inf=flag, skip_if=flag))
    )
    assert torch.equal(_bits(again), _bits(ours))


def test_found_inf_and_skip_if_views_of_one_buffer() -> None:
    n = 3 * BLOCK + 5
    param, grad = _with_bad_grads(n, [n - 2])
    flags = torch.zeros(2)
    ours = param.clone()
    triton_backend.lomo_update_(
        ours,
        grad,
        *_args(_materialise(_options(**FULL)) | dict(found_inf=flags[0:1], skip_if=flags[1:2])),
    )
    theirs = param.clone()
    reference.lomo_update_(
        theirs,
        grad,
        *_args(
            _materialise(_options(**FULL)) | dict(found_inf=torch.zeros(1), skip_if=torch.zeros(1))
        ),
    )
    assert torch.equal(_bits(ours), _bits(theirs))
    assert flags.tolist() == [1.0, 0.0]


# ----------------------------------------------------------------------------- sum of squares


@pytest.mark.parametrize(
    ("n", "dtype"),
    [(n, dtype) for n in SMALL_SIZES for dtype in DTYPES] + [(278011, "bf16")],
)
def test_grad_sumsq(n: int, dtype: str) -> None:
    _, grad = _inputs(n, torch.float32, DTYPES[dtype], seed=n)
    inv_scale = torch.tensor([1.5])  # the effective value of the former pair 0.5 * [3.0]
    sumsq = torch.tensor([2.0])
    found_inf = torch.zeros(1)
    triton_backend.grad_sumsq_(grad, inv_scale, sumsq, found_inf)
    exact = 2.0 + ((grad.double() * 1.5) ** 2).sum().item()
    ref_sumsq = torch.tensor([2.0])
    reference.grad_sumsq_(grad, inv_scale, ref_sumsq, None)
    # Partial sums per program make the order differ from torch.dot, not the accuracy: each
    # within its backend's worst-case bound for its order of additions.
    assert sumsq.item() == pytest.approx(exact, rel=sumsq_rel_bound("triton", n))
    assert ref_sumsq.item() == pytest.approx(exact, rel=sumsq_rel_bound("torch", n))
    assert found_inf.item() == 0.0


@pytest.mark.parametrize("position", [0, BLOCK + 1, 2 * BLOCK + 3])
def test_grad_sumsq_non_finite(position: int) -> None:
    _, grad = _inputs(2 * BLOCK + 5, torch.float32, torch.float16)
    grad[position] = float("nan")
    sumsq, found_inf = torch.zeros(1), torch.zeros(1)
    triton_backend.grad_sumsq_(grad, None, sumsq, found_inf)
    assert found_inf.item() == 1.0
    assert not torch.isfinite(sumsq).item()


def test_grad_sumsq_without_found_inf() -> None:
    _, grad = _inputs(33, torch.float32, torch.float32)
    sumsq = torch.zeros(1)
    triton_backend.grad_sumsq_(grad, torch.tensor([2.0]), sumsq, None)
    exact = ((grad.double() * 2) ** 2).sum().item()
    assert sumsq.item() == pytest.approx(exact, rel=sumsq_rel_bound("triton", grad.numel()))


# ----------------------------------------------------------------------------- accumulation

ACCUMULATE_PAIRS = [("fp32", "fp32"), ("bf16", "bf16"), ("bf16", "fp32"), ("fp16", "fp16"),
                    ("fp16", "bf16")]  # fmt: skip


@pytest.mark.parametrize("n", [1, 7, BLOCK + 16, 2 * BLOCK + 5], ids=lambda n: f"n{n}")
@pytest.mark.parametrize(
    "bdt,gdt", ACCUMULATE_PAIRS, ids=[f"b{b}-g{g}" for b, g in ACCUMULATE_PAIRS]
)
def test_grad_accumulate_matches_reference(bdt: str, gdt: str, n: int) -> None:
    # The stored bits of both roundings, adding and the first pass, as the reference's (the
    # bulk, the 16-element tail, a lone element); the sum within the Triton order's bound.
    buffer, grad = _inputs(n, DTYPES[bdt], DTYPES[gdt], seed=n)
    inv = torch.tensor([0.25])
    for first in (False, True):
        for sr in roundings(bdt):
            (got, want), (s_got, s_want), (f_got, f_want) = accumulate_both(
                triton_backend, buffer, grad, first=first, inv_scale=inv, sr=sr, seed=n,
                seed_step=torch.tensor([5], dtype=torch.int64),
            )  # fmt: skip
            assert_same_stored(got, want)
            assert f_got.item() == f_want.item() == 0.0
            exact = 0.75 + ((got.float() * 0.25).double() ** 2).sum().item()
            assert s_got.item() == pytest.approx(exact, rel=sumsq_rel_bound("triton", n))


@pytest.mark.parametrize("position", [0, BLOCK + 1, 2 * BLOCK + 3])
def test_grad_accumulate_non_finite(position: int) -> None:
    buffer, grad = _inputs(2 * BLOCK + 5, torch.bfloat16, torch.float16)
    grad[position] = float("inf")
    (got, want), (s_got, _), (f_got, f_want) = accumulate_both(triton_backend, buffer, grad)
    assert_same_stored(got, want)
    assert f_got.item() == f_want.item() == 1.0
    assert not torch.isfinite(s_got).item()


# ----------------------------------------------------------------------------- 8-bit buffer

# The 8-bit blockwise buffer (core/int8_blocks.py): slices of awkward lengths at awkward flat
# offsets of their parameter (partial first and last blocks, a single block, an offset past
# 2**32), each op bit for bit as the reference. 278011 elements (68 programs) only where named:
# the interpreter is slow.
INT8_SLICES = [(1, 0), (7, 255), (255, 1), (256, 0), (256, 300), (257, 256), (4097, 2**32 + 5),
               (4097, 1)]  # fmt: skip
INT8_LARGE = (278011, 300)


def _slice_id(case: tuple[int, int]) -> str:
    return f"n{case[0]}-at{case[1]}"


def _int8_buffer(n: int, offset: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of n elements at `offset`: random codes and a different power of two per
    block, between 2**-10 and 2**-6 (code * scale * 0.75 stays below FULL's clip value, so a
    block's scale shows in the update), one block all zero when there are several."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (n,), generator=gen, dtype=torch.int8)
    count = blocks_of(offset, n)
    scales = torch.exp2(torch.randint(-10, -5, (count,), generator=gen).float())
    if count > 1:
        scales[1] = 0.0
    return codes, scales


def _accumulate_int8_both(
    codes: torch.Tensor,
    scales: torch.Tensor,
    grad: torch.Tensor,
    offset: int,
    *,
    first: bool = False,
    sr: bool = False,
    seed: int = 0,
) -> tuple[tuple, tuple, tuple, tuple]:
    """The Triton and the reference accumulation on copies, each with sumsq (from 0.75),
    found_inf, inv_scale 0.25 and a per-step seed: (codes), (scales), (sumsqs), (flags)."""
    results = []
    for module in (triton_backend, reference):
        c, sc, sumsq, found = codes.clone(), scales.clone(), torch.tensor([0.75]), torch.zeros(1)
        step = torch.tensor([5], dtype=torch.int64)
        module.grad_accumulate_int8_(
            c, sc, grad, offset, first, torch.tensor([0.25]), sumsq, found, sr, seed, step
        )
        results.append((c, sc, sumsq, found))
    return tuple(zip(*results, strict=True))  # type: ignore[return-value]


def _assert_same_int8_accumulation(
    offset: int, codes: tuple, scales: tuple, sums: tuple, flags: tuple
) -> None:
    """Codes and scales bit for bit (nan scales included), found_inf equal, sumsq within the
    Triton order's bound of 0.75 + the float64 sum of the stored values' squares times
    0.25**2 (`_accumulate_int8_both`)."""
    assert torch.equal(codes[0], codes[1])
    assert torch.equal(_bits(scales[0]), _bits(scales[1]))
    assert flags[0].item() == flags[1].item()
    stored = reference.int8_dequantized(codes[0], scales[0], offset) * 0.25
    exact = 0.75 + (stored.double() ** 2).sum().item()
    if math.isfinite(exact):
        bound = sumsq_rel_bound("triton", codes[0].numel())
        assert sums[0].item() == pytest.approx(exact, rel=bound)
        assert flags[0].item() == 0.0
    else:
        assert not math.isfinite(sums[0].item()) and flags[0].item() == 1.0


@pytest.mark.parametrize("case", INT8_SLICES, ids=_slice_id)
def test_grad_accumulate_int8_matches_reference(case: tuple[int, int]) -> None:
    """Every gradient dtype, adding and the first pass, both roundings."""
    n, offset = case
    codes, scales = _int8_buffer(n, offset, seed=n)
    for dtype in DTYPES.values():
        gen = torch.Generator().manual_seed(offset % 97)
        grad = (torch.randn(n, generator=gen) / 64).to(dtype)
        for first in (False, True):
            for sr in (False, True):
                both = _accumulate_int8_both(
                    codes, scales, grad, offset, first=first, sr=sr, seed=n
                )
                _assert_same_int8_accumulation(offset, *both)


def test_fp16_subnormal_ties() -> None:
    """Every element's update a tie of fp16's subnormal stochastic rounding: down for an odd
    random value, up for an even one, as the reference (support/fp16_edges.py)."""
    check_subnormal_ties_match_reference(triton_backend)


@pytest.mark.parametrize(("size", "offset"), [(257, 0), (4097, 2**32 + 5)])
def test_grad_accumulate_int8_stochastic_ties(size: int, offset: int) -> None:
    """Every element a tie of the stochastic rounding (x + u an integer): rounded down for an
    odd random value, up for an even one, as in the reference."""
    check_stochastic_ties(triton_backend, size, offset, torch.tensor([5], dtype=torch.int64))


@pytest.mark.parametrize(
    ("dtype", "first", "sr", "offset"), [("bf16", False, True, 2**32 + 5), ("fp32", True, False, 0)]
)
def test_grad_accumulate_int8_large(dtype: str, first: bool, sr: bool, offset: int) -> None:
    """Many programs: aligned blocks (offset 0, the 128-bit path on a GPU) and not."""
    n = INT8_LARGE[0]
    codes, scales = _int8_buffer(n, offset, seed=3)
    grad = (torch.randn(n, generator=torch.Generator().manual_seed(4)) / 64).to(DTYPES[dtype])
    both = _accumulate_int8_both(codes, scales, grad, offset, first=first, sr=sr, seed=9)
    _assert_same_int8_accumulation(offset, *both)


def _fp32_of_bits(patterns: list[int]) -> torch.Tensor:
    return torch.tensor(patterns, dtype=torch.int64).to(torch.int32).view(torch.float32)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, inside the interpreter
def test_grad_accumulate_int8_scale_rule_and_ties() -> None:
    """One block per case (offset 0, first pass, so new = grad): the scale's edges, from the
    bits of absmax, under both roundings; to nearest, ties go to even."""
    cases = {
        # absmax 127 = 1.984375 * 2**6: the largest mantissa of scale 1; ties 2.5, 3.5, -0.5.
        1.0: [127.0, 2.5, 3.5, -0.5, -0.0, 1e-30],
        # the next float above 127 needs scale 2.
        2.0: [_fp32_of_bits([0x42FE0001]).item(), -3.0, 5.0],
        # all zero: scale 0, codes 0.
        0.0: [0.0, -0.0],
        # subnormal absmax: the exponent's floor, 2**-126.
        2.0**-126: [_fp32_of_bits([0x00000005]).item(), -(2.0**-140)],
        # the largest float: 2**122, code 64 (63.99... to nearest).
        2.0**122: [_fp32_of_bits([0x7F7FFFFF]).item(), -(2.0**123), 1.0],
    }
    grad = torch.zeros(INT8_BLOCK * len(cases))
    for block, values in enumerate(cases.values()):
        grad[block * INT8_BLOCK : block * INT8_BLOCK + len(values)] = torch.tensor(values)
    codes, scales = torch.zeros(grad.numel(), dtype=torch.int8), torch.zeros(len(cases))
    for sr in (False, True):
        both = _accumulate_int8_both(codes, scales, grad, 0, first=True, sr=sr, seed=1)
        _assert_same_int8_accumulation(0, *both)
        assert both[1][0].tolist() == list(cases)
    got = _accumulate_int8_both(codes, scales, grad, 0, first=True)[0][0].view(-1, INT8_BLOCK)
    assert got[0, :6].tolist() == [127, 2, 4, 0, 0, 0]
    assert got[1, :3].tolist() == [64, -2, 2]  # 63.5000..., and ties -1.5, 2.5 to even
    assert got[3, :2].tolist() == [0, 0]
    assert got[4, :3].tolist() == [64, -2, 0]  # 63.99998..., -2, 2**-122


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, inside the interpreter
@pytest.mark.parametrize("case", [(4097, 2**32 + 5), (7, 255)], ids=_slice_id)
def test_grad_accumulate_int8_non_finite(case: tuple[int, int]) -> None:
    """inf and nan gradients (first, middle and last element: a partial first and last block)
    and an old nan scale: their blocks store codes 0 and scale nan, the others as usual;
    found_inf raised and sumsq nan, as the reference."""
    n, offset = case
    codes, scales = _int8_buffer(n, offset, seed=8)
    grad = (torch.randn(n, generator=torch.Generator().manual_seed(8)) / 64).to(torch.bfloat16)
    for position, value in zip([0, n // 2, n - 1], [INF, float("nan"), -INF], strict=True):
        grad[position] = value
    left_bad = len(scales) // 4  # a block left non-finite by an earlier micro-batch
    scales[left_bad] = float("nan")
    for first in (False, True):
        both = _accumulate_int8_both(codes, scales, grad, offset, first=first, sr=True, seed=2)
        _assert_same_int8_accumulation(offset, *both)
        assert both[3][0].item() == 1.0
        blocks = reference._block_of(offset, n, torch.device("cpu"))
        bad = blocks[[0, n // 2, n - 1]]
        assert bool(both[1][0][bad].isnan().all())
        assert bool((both[0][0][blocks == bad[1]] == 0).all())
        if left_bad not in bad.tolist():  # adding keeps it non-finite; the first pass drops it
            assert both[1][0][left_bad].isnan().item() is not first


def _update_int8_both(
    param: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offset: int, **options: object
) -> tuple[torch.Tensor, torch.Tensor, dict, dict]:
    """Runs the Triton and the reference update from an 8-bit buffer on copies of `param`:
    (ours, theirs, our options, theirs), as `_both`."""
    ours, theirs = param.clone(), param.clone()
    opts_ours, opts_theirs = _materialise(_options(**options)), _materialise(_options(**options))
    # Without the dense op's trailing offset: the 8-bit op takes the buffer's after scales.
    triton_backend.lomo_update_int8_(ours, codes, scales, offset, *_args(opts_ours)[:-1])
    reference.lomo_update_int8_(theirs, codes, scales, offset, *_args(opts_theirs)[:-1])
    return ours, theirs, opts_ours, opts_theirs


# Every option of the update: FULL, found_inf, skip_if given and clear, a per-step seed.
INT8_UPDATE_OPTIONS = dict(FULL, found_inf=[0.0], skip_if=[0.0], seed=2**40 + 3)


@pytest.mark.parametrize("case", INT8_SLICES, ids=_slice_id)
def test_lomo_update_int8_matches_reference(case: tuple[int, int]) -> None:
    """Every parameter dtype, both roundings, every option; then with none."""
    n, offset = case
    codes, scales = _int8_buffer(n, offset, seed=n + 1)
    for dtype in DTYPES.values():
        param = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
        for sr in (False, True) if dtype != torch.float32 else (False,):
            step = torch.tensor([7], dtype=torch.int64)
            options = dict(INT8_UPDATE_OPTIONS, stochastic_rounding=sr, seed_step=step)
            ours, theirs, opts, ref_opts = _update_int8_both(
                param, codes, scales, offset, **options
            )
            assert torch.equal(_bits(ours), _bits(theirs))
            assert opts["found_inf"].item() == ref_opts["found_inf"].item() == 0.0
        plain, expected, _, _ = _update_int8_both(param, codes, scales, offset)
        assert torch.equal(_bits(plain), _bits(expected))


def test_lomo_update_int8_large() -> None:
    n, offset = INT8_LARGE
    codes, scales = _int8_buffer(n, offset, seed=5)
    param = torch.randn(n, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    step = torch.tensor([2**31 + 7], dtype=torch.int64)
    options = dict(INT8_UPDATE_OPTIONS, stochastic_rounding=True, seed_step=step)
    ours, theirs, _, _ = _update_int8_both(param, codes, scales, offset, **options)
    assert torch.equal(_bits(ours), _bits(theirs))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, inside the interpreter
@pytest.mark.parametrize("case", [(4097, 300), (17, 250)], ids=_slice_id)
def test_lomo_update_int8_non_finite_and_skip(case: tuple[int, int]) -> None:
    """A nan block (the bulk's first, the tail's last) and a value that overflows times
    inv_scale keep their elements and raise found_inf; a set skip_if writes nothing."""
    n, offset = case
    codes, scales = _int8_buffer(n, offset, seed=6)
    scales[0], scales[-1] = float("nan"), 2.0**122
    codes[-1] = 127  # 127 * 2**122 * 10 overflows
    param = torch.randn(n, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    options = dict(INT8_UPDATE_OPTIONS, inv_scale=[10.0], stochastic_rounding=True)
    ours, theirs, opts, ref_opts = _update_int8_both(param, codes, scales, offset, **options)
    assert torch.equal(_bits(ours), _bits(theirs))
    blocks = reference._block_of(offset, n, torch.device("cpu"))
    assert torch.equal(_bits(ours[blocks == 0]), _bits(param[blocks == 0]))
    assert _bits(ours[-1]).item() == _bits(param[-1]).item()
    assert opts["found_inf"].item() == ref_opts["found_inf"].item() == 1.0
    skipped, _, opts, _ = _update_int8_both(
        param, codes, scales, offset, **dict(options, found_inf=[0.0], skip_if=[1.0])
    )
    assert torch.equal(_bits(skipped), _bits(param)) and opts["found_inf"].item() == 0.0


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, inside the interpreter
@pytest.mark.parametrize("case", INT8_SLICES, ids=_slice_id)
def test_int8_dequantize_matches_reference(case: tuple[int, int]) -> None:
    """Every output dtype; scales 0, nan, and beyond fp16's range both ways (inf, subnormals
    rounded to nearest even)."""
    n, offset = case
    codes, scales = _int8_buffer(n, offset, seed=n + 2)
    scales[-1] = float("nan")
    if len(scales) > 3:
        scales[2], scales[3] = 2.0**10, 2.0**-21
    for dtype in DTYPES.values():
        ours, theirs = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
        triton_backend.int8_dequantize_(ours, codes, scales, offset)
        reference.int8_dequantize_(theirs, codes, scales, offset)
        assert_same_stored(ours, theirs)  # nan payloads are torch's own
        assert bool(ours[-1].isnan())


def test_int8_public_functions_run_the_triton_kernels() -> None:
    """The public functions, Python-float scalars converted once, on the Triton backend: the
    reference's results through the same functions."""
    n, offset = 300, 2**32 + 200
    grad = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    param = torch.randn(n, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    results = []
    for backend in ("triton", "torch"):
        codes = torch.empty(n, dtype=torch.int8)
        scales = torch.empty(blocks_of(offset, n))
        sumsq, found_inf, p, out = torch.zeros(1), torch.zeros(1), param.clone(), param.clone()
        common = dict(offset=offset, stochastic_rounding=True, seed=5, backend=backend)
        ops.grad_accumulate_int8_(
            codes, scales, grad, first=True, inv_scale=0.5, sumsq=sumsq, **common
        )
        ops.lomo_update_int8_(
            p, codes, scales, lr=0.1, inv_scale=0.5, found_inf=found_inf, **common
        )
        ops.int8_dequantize_(out, codes, scales, offset=offset, backend=backend)
        results.append((codes, scales, p, out, found_inf))
    for ours, theirs in zip(*results, strict=True):
        assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))  # every byte


def test_int8_ops_launch_arguments() -> None:
    """The lead is the offset within its block; the accumulation takes whole blocks per
    program and rounds stochastically for any gradient dtype (codes are always rounded)."""
    n, offset = 5 * INT8_BLOCK, 2**32 + 300
    codes, scales = _int8_buffer(n, offset, seed=0)
    grid, args = triton_backend.grad_accumulate_int8_args(
        GRAD_ACCUMULATE_INT8.Arguments(
            codes, scales, torch.zeros(n), offset, False, None, None, None, True, 3, None
        )
    )
    assert grid == (1,) and args["lead"] == 44 and args["n_blocks"] == 6 == len(scales)
    assert args["STOCHASTIC_ROUNDING"] is True and args["offset"] == offset


# ----------------------------------------------------------------------------- availability

_LATE_INTERPRET = r"""
import os, torch
from lomo_kernels.ops.lomo import triton_backend as triton_backend
from lomo_kernels.ops.lomo import reference as reference
assert not triton_backend.is_available()
os.environ["TRITON_INTERPRET"] = "1"
assert triton_backend.is_available()
p = torch.randn(40).to(torch.bfloat16)
g = torch.randn(40).to(torch.bfloat16)
g[3] = float("inf")
lr = torch.tensor([0.1])
a, b, fa, fb = p.clone(), p.clone(), torch.zeros(1), torch.zeros(1)
# (param, grad, lr, inv_scale, clip_value, clip_coef, weight_decay, found_inf, skip_if,
#  stochastic_rounding, seed, seed_step, offset)
triton_backend.lomo_update_(a, g, lr, None, None, None, 0.0, fa, None, False, 0, None, 0)
reference.lomo_update_(b, g, lr, None, None, None, 0.0, fb, None, False, 0, None, 0)
assert torch.equal(a.view(torch.int16), b.view(torch.int16)) and fa.item() == fb.item() == 1
s = torch.zeros(1)
triton_backend.grad_sumsq_(g.nan_to_num(posinf=0.0), None, s, None)
assert s.item() > 0
print("ok")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only availability rule")
def test_interpreter_enabled_after_triton_was_imported() -> None:
    """TRITON_INTERPRET set after the kernels (and triton) were imported still works."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", _LATE_INTERPRET],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-4000:]


# ----------------------------------------------------------------------------- AdaLomo write-back

# The AdaLomo write-back passes round as the LOMO update (bf16 and fp16, stochastically from
# the seed, its per-step part and each element's flat index in the whole parameter). Their
# inputs (moments, workspace sums) come from the reference's earlier passes, so both
# backends write back from the same values and must agree bit for bit. But for the sums of
# p^2 and update^2: they are set to numel * (exact square), since the write-back takes
# their rms and torch.sqrt on CPU is not always correctly rounded (1 ulp off for about a
# fifth of fp32 inputs with torch 2.13 on AVX-512) while the kernels' sqrt_rn is, which
# would make the scale, not the rounding, differ.
ADA_SCALARS = dict(lr=0.05, eps1=1e-3, clip_threshold=0.8, weight_decay=0.1)
ADA_GRAD = dict(inv_scale=1.0 / 1024, clip_value=1.5, clip_coef=0.37)
ADA_BETA2, ADA_EPS0 = 0.5, 1e-30
LOW_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _t(value: float) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.float32)


def _ada_prepared(
    shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor]:
    """(param, grad, state, workspace) of a first step, the reference's passes before the
    write-back run (A, the moments and B; or A1)."""
    gen = torch.Generator().manual_seed(seed)
    param = torch.randn(shape, generator=gen).to(dtype)
    grad = (1024 * torch.randn(shape, generator=gen)).to(dtype)
    inv, cv, cc = _t(ADA_GRAD["inv_scale"]), ADA_GRAD["clip_value"], _t(ADA_GRAD["clip_coef"])
    workspace = torch.zeros(workspace_numel(param.shape))
    if param.dim() >= 2:
        cols = shape[-1]
        rows = param.numel() // cols
        state = (torch.zeros(rows), torch.zeros(cols))
        ada_reference.factored_stats_(grad, param, workspace, None, None, cols, inv, cv, 0)
        ada_reference.factored_moments_(*state, workspace, _t(ADA_BETA2), cc, ADA_EPS0)
        ada_reference.factored_norm_(grad, *state, workspace, inv, cv, cc, 0)
    else:
        state = (torch.zeros(param.numel()),)
        ada_reference.vector_stats_(
            grad, param, *state, workspace, None, None, _t(ADA_BETA2), ADA_EPS0, inv, cv, cc
        )
    # rms(p) = 0.5 and rms(update) = 1.5, exactly (the update is clipped: 1.5 > 0.8).
    workspace[workspace.numel() - NUM_SLOTS + P_SUMSQ] = param.numel() * 0.25
    workspace[workspace.numel() - NUM_SLOTS + U_SUMSQ] = param.numel() * 2.25
    return param, grad, state, workspace


def _ada_apply(
    backend,
    param: torch.Tensor,
    grad: torch.Tensor,
    state: tuple[torch.Tensor, ...],
    workspace: torch.Tensor,
    *,
    scalars: dict = ADA_SCALARS,
    grad_options: dict | None = ADA_GRAD,
    beta2: float = ADA_BETA2,
    stochastic_rounding: bool = True,
    seed: int = 2**40 + 3,
    seed_step: torch.Tensor | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """`backend`'s write-back pass on copies of the parameter and state: (param, state)."""
    param, state = param.clone(), tuple(s.clone() for s in state)
    step = (_t(scalars["lr"]), scalars["eps1"], scalars["clip_threshold"], scalars["weight_decay"])
    transform = (None, None, None)
    if grad_options is not None:
        transform = (
            _t(grad_options["inv_scale"]),
            grad_options["clip_value"],
            _t(grad_options["clip_coef"]),
        )
    rounding = (stochastic_rounding, seed, seed_step)
    if param.dim() >= 2:
        backend.factored_apply_(param, grad, *state, workspace, *step, *transform, *rounding, 0)
    else:
        backend.vector_apply_(
            param,
            grad,
            *state,
            workspace,
            _t(beta2),
            ADA_EPS0,
            *step,
            *transform,
            *rounding,
            0,
            param.numel(),
        )
    return param, state


def _assert_same_write_back(
    ours: tuple[torch.Tensor, tuple[torch.Tensor, ...]],
    theirs: tuple[torch.Tensor, tuple[torch.Tensor, ...]],
) -> None:
    assert torch.equal(_bits(ours[0]), _bits(theirs[0]))
    for mine, reference_state in zip(ours[1], theirs[1], strict=True):
        assert torch.equal(_bits(mine), _bits(reference_state))


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize(
    "shape", [(1,), (7,), (4097,), (278011,), (1, 7), (2, 3, 7), (37, 1031)], ids=str
)
def test_adalomo_write_back_stochastic_bit_identical(shape: tuple, dtype: str) -> None:
    prepared = _ada_prepared(shape, LOW_PRECISION[dtype], seed=len(shape))
    ours = _ada_apply(triton_adalomo, *prepared)
    _assert_same_write_back(ours, _ada_apply(ada_reference, *prepared))
    if prepared[0].numel() >= 4097:  # and not the nearest rounding
        nearest = _ada_apply(triton_adalomo, *prepared, stochastic_rounding=False)
        assert not torch.equal(_bits(ours[0]), _bits(nearest[0]))


def _gpu_tiling(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launchers' CUDA tiling (132 SMs, as an H100's) for CPU tensors."""
    tiling = triton_adalomo._tiling
    monkeypatch.setattr(triton_adalomo, "_sm_count", lambda index: 132)
    monkeypatch.setattr(
        triton_adalomo,
        "_tiling",
        lambda rows, cols, device: tiling(rows, cols, torch.device("cuda", 0)),
    )


def _small_tiling(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small interpreter tiles: column blocks, and several tiles per program."""
    monkeypatch.setattr(triton_adalomo, "INTERPRETER_TILE", 256)
    monkeypatch.setattr(triton_adalomo, "INTERPRETER_MAX_BLOCK_N", 32)
    monkeypatch.setattr(triton_adalomo, "INTERPRETER_PROGRAMS", 16)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("tiling", ["gpu", "small"])
def test_adalomo_factored_write_back_tilings(
    monkeypatch: pytest.MonkeyPatch, tiling: str, dtype: str
) -> None:
    """Each tile rounds its elements with their indices in the whole parameter: the bits do
    not depend on how the launch cuts the matrix."""
    {"gpu": _gpu_tiling, "small": _small_tiling}[tiling](monkeypatch)
    grid, sizes = triton_adalomo._tiling(37, 1031, torch.device("cpu"))
    assert grid[0] > 1 and (grid[1] > 1 or sizes["rows_per_prog"] > sizes["BLOCK_M"])
    prepared = _ada_prepared((37, 1031), LOW_PRECISION[dtype], seed=3)
    seed_step = torch.tensor([41], dtype=torch.int64)
    ours = _ada_apply(triton_adalomo, *prepared, seed_step=seed_step)
    _assert_same_write_back(ours, _ada_apply(ada_reference, *prepared, seed_step=seed_step))


@pytest.mark.parametrize("step", [0, 2**31 + 7, -3, 2**40 + 9])
@pytest.mark.parametrize(("shape", "dtype"), [((4097,), "fp16"), ((37, 1031), "bf16")], ids=str)
def test_adalomo_write_back_seed_step_from_device(shape: tuple, dtype: str, step: int) -> None:
    """The per-step value read by the kernel: the reference's bits, which are the seed's
    with the step's low 32 bits XORed into its high half."""
    prepared = _ada_prepared(shape, LOW_PRECISION[dtype], seed=5)
    seed_step = torch.tensor([step], dtype=torch.int64)
    ours = _ada_apply(triton_adalomo, *prepared, seed=2**33 + 11, seed_step=seed_step)
    theirs = _ada_apply(ada_reference, *prepared, seed=2**33 + 11, seed_step=seed_step)
    _assert_same_write_back(ours, theirs)
    folded = (2**33 + 11) ^ ((step & 0xFFFFFFFF) << 32)
    _assert_same_write_back(ours, _ada_apply(triton_adalomo, *prepared, seed=folded))


def _ada_exact(
    value: torch.Tensor, param: torch.Tensor, factored: bool
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor]:
    """Inputs whose write-back computes p * 1 - 1 * g exactly, g = -`value` then 0 (for the
    rest of `param`): unit moments (r = c = 1, or v = 1 kept by beta2 = 1), sums of zero
    (lr_t = lr * eps1 = 1, no clip), no decay."""
    grad = torch.cat([-value, torch.zeros(len(param) - len(value))])
    if factored:
        param, grad = param.view(2, -1), grad.view(2, -1)
        rows, cols = param.shape
        state = (torch.ones(rows), torch.ones(cols))
        workspace = torch.zeros(rows + cols + NUM_SLOTS)
        workspace[rows + cols + R_SUM] = rows
    else:
        state = (torch.ones(param.numel()),)
        workspace = torch.zeros(NUM_SLOTS)
    assert workspace[-NUM_SLOTS + P_SUMSQ] == workspace[-NUM_SLOTS + U_SUMSQ] == 0
    return param, grad, state, workspace


EXACT = dict(
    scalars=dict(lr=1.0, eps1=1.0, clip_threshold=1.0, weight_decay=0.0),
    grad_options=None,
    beta2=1.0,
)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, inside the interpreter
@pytest.mark.parametrize("factored", [False, True], ids=["1d", "factored"])
@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_adalomo_write_back_rounding_of_edge_values(dtype: str, factored: bool) -> None:
    """The write-back of exact fp32 values v (p = 0 - (-v)): subnormals, 2^-14, 65504 and
    beyond; inf, nan and -0.0 parameters with a zero gradient keep their values."""
    value = _fp32_from_bits(FP16_EDGE_PATTERNS)
    specials = torch.tensor([INF, -INF, float("nan"), -float("nan"), -0.0, 0.0])
    param = torch.cat([torch.zeros(len(value)), specials]).to(LOW_PRECISION[dtype])
    prepared = _ada_exact(value, param, factored)
    ours = _ada_apply(triton_adalomo, *prepared, **EXACT, seed_step=torch.tensor([3]))
    _assert_same_write_back(
        ours, _ada_apply(ada_reference, *prepared, **EXACT, seed_step=torch.tensor([3]))
    )
    # The inputs give v itself: rounded to nearest, it is v's nearest value.
    nearest = _ada_apply(ada_reference, *prepared, **EXACT, stochastic_rounding=False)
    expected = _rounding.round_to_dtype(value, LOW_PRECISION[dtype])
    assert torch.equal(_bits(nearest[0].reshape(-1)[: len(value)]), _bits(expected))
    out = ours[0].reshape(-1)
    if dtype == "fp16":
        _check_fp16_stochastic(out[: len(value)], value)
    assert _bits(out[len(value) :]).tolist() == _bits(param[len(value) :]).tolist()


@pytest.mark.parametrize("shape", [(4097,), (37, 1031)], ids=str)
@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_adalomo_write_back_skip_leaves_bits(shape: tuple, dtype: str) -> None:
    """A set SKIP slot: neither the parameter nor the 1-D moment is written."""
    param, grad, state, workspace = _ada_prepared(shape, LOW_PRECISION[dtype], seed=7)
    workspace[workspace.numel() - NUM_SLOTS + SKIP] = 1.0
    ours = _ada_apply(triton_adalomo, param, grad, state, workspace, seed_step=torch.tensor([5]))
    _assert_same_write_back(ours, (param, state))


def test_adalomo_fp32_write_back_ignores_stochastic_rounding() -> None:
    """fp32 parameters store the result exactly: the nearest variant, as in the reference."""
    for shape in [(33,), (5, 7)]:
        prepared = _ada_prepared(shape, torch.float32)
        ours = _ada_apply(triton_adalomo, *prepared, seed_step=torch.tensor([1]))
        nearest = _ada_apply(triton_adalomo, *prepared, stochastic_rounding=False)
        _assert_same_write_back(ours, nearest)
        _assert_same_write_back(ours, _ada_apply(ada_reference, *prepared))
