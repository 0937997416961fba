"""fused_sgd_update_ on every backend against an independent float64 model."""

from __future__ import annotations

import pytest
import torch
from float64_reference import assert_within_ulp, lomo_update_f64

from lomo_kernels import ops

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SIZES = [1, 7, 15, 16, 4097, 278011, 2**20 + 3]
OPTIONS = {
    "plain": {},
    "inv_scale": {"inv_scale": 2.0**-12},
    "clip_value": {"clip_value": 0.5},
    "clip_coef": {"clip_coef": 0.37},
    "weight_decay": {"weight_decay": 0.1},
    "all": {"inv_scale": 2.0**-12, "clip_value": 0.5, "clip_coef": 0.37, "weight_decay": 0.1},
}
LR = 0.05
# fp32 parameters: the fp32 chain rounds up to four times (g*clip_coef, lr*g, p*decay, the
# sum), each by at most half an ulp of the largest operand, so the bound is 2 ulp there.
# bf16/fp16 parameters: the final rounding dominates, 1 ulp at the result.
FP32_ULPS = 2.0


def bound_kwargs(param_dtype, original, lr_g):
    if param_dtype != torch.float32:
        return {}
    return {"scale": torch.maximum(original.double().abs(), lr_g), "ulps": FP32_ULPS}


def make_inputs(n, param_dtype, grad_dtype, *, inv_scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed + n)
    param = torch.randn(n, generator=gen).to(param_dtype)
    # Scaled gradients, as a loss scaler would produce them, spanning clip_value.
    grad = (torch.randn(n, generator=gen) * 1.5 / inv_scale).to(grad_dtype)
    return param, grad


def check_update(backend, n, param_dtype, grad_dtype, options, *, as_tensors=False):
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
