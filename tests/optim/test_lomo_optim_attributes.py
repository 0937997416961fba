"""The attributes lomo-optim's code and its official trainer read, against lomo_optim itself."""

from __future__ import annotations

import pytest
import torch
from support.dependencies import require
from support.float64 import FP32_NORM_RTOL as NORM_RTOL
from torch import nn

from lomo_kernels import AdaLomo, Lomo

lomo_optim = require("lomo_optim")

LR = 0.05


def assert_params_close(ours, theirs, steps: int) -> None:
    """Parameters after `steps` steps taken on both sides: each step's write rounds by
    <= 1/2 ulp on each side, and the update lr * c * g differs by the coefficient's
    NORM_RTOL, orders of magnitude below an ulp of p: <= 1 ulp of the largest parameter per
    step, held to 2 (eps * max|p| is between 1 and 2 ulps of it)."""
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        ulp = torch.finfo(b.dtype).eps * b.detach().abs().max().item()
        torch.testing.assert_close(a, b, rtol=0, atol=2 * steps * ulp)


def pair(dtype=torch.float32):
    """Two identical small models (a plain module: lomo_optim treats any nn.Module)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 8)).to(dtype)
    twin = nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 8)).to(dtype)
    twin.load_state_dict(model.state_dict())
    return model, twin


def loss_of(model, step, scale=1.0):
    dtype = next(model.parameters()).dtype
    gen = torch.Generator().manual_seed(step)
    x = (torch.randn(8, 16, generator=gen) * scale).to(dtype)
    return (model(x) ** 2).mean()  # in the model's dtype, as lomo_optim detects fp16 by it


@pytest.fixture
def cuda_is_identity(monkeypatch):
    """lomo_optim.AdaLomo allocates its state with a hard-coded .cuda(): keep it on CPU."""
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)


@pytest.mark.parametrize("cls", ["Lomo", "AdaLomo"])
def test_clip_coef_grad_norms_and_lr_as_lomo_optim(cuda_is_identity, cls):
    model, twin = pair()
    kwargs = {"clip_grad_norm": 0.05, "weight_decay": 0.01}
    ours = {"Lomo": Lomo, "AdaLomo": AdaLomo}[cls](model, lr=LR, **kwargs)
    theirs = getattr(lomo_optim, cls)(twin, lr=LR, **kwargs)
    assert ours.clip_coef is None and theirs.clip_coef is None
    assert ours.grad_norms == [] and theirs.grad_norms == []
    assert ours.lr == theirs.lr == LR
    for step in range(3):
        lr = LR * (1 - step / 4)
        ours.grad_norm(loss_of(model, step))
        loss = loss_of(twin, step)
        theirs.grad_norm(loss)
        assert isinstance(ours.clip_coef, torch.Tensor) and ours.clip_coef.dim() == 0
        assert float(ours.clip_coef) == pytest.approx(float(theirs.clip_coef), rel=NORM_RTOL)
        assert float(ours.clip_coef) < 1  # the threshold is below the norm: clipping is on
        total = float(torch.norm(ours.grad_norms))
        assert total == pytest.approx(float(torch.norm(theirs.grad_norms)), rel=NORM_RTOL)
        # One entry per gradient, as lomo-optim's (in model order; its list is in backward's)
        assert sorted(ours.grad_norms.tolist()) == pytest.approx(
            sorted(float(n) for n in theirs.grad_norms), rel=NORM_RTOL
        )
        ours.fused_backward(loss_of(model, step), lr)
        theirs.fused_backward(loss, lr)
        assert isinstance(ours.lr, float) and ours.lr == theirs.lr == lr
    assert ours.weight_decay == theirs.weight_decay
    assert_params_close(model, twin, steps=3)  # seen on AVX2: 1 ulp


def test_adalomo_hyper_parameters_and_step_num_as_lomo_optim(cuda_is_identity):
    model, twin = pair()
    kwargs = {"eps": (1e-29, 2e-3), "clip_threshold": 0.7, "decay_rate": -0.6}
    ours, theirs = AdaLomo(model, lr=LR, **kwargs), lomo_optim.AdaLomo(twin, lr=LR, **kwargs)
    for name in ("eps", "clip_threshold", "decay_rate", "loss_scale", "step_num"):
        assert getattr(ours, name) == getattr(theirs, name), name
    for step in range(3):
        ours.fused_backward(loss_of(model, step), LR)
        theirs.fused_backward(loss_of(twin, step), LR)
        assert ours.step_num == theirs.step_num == step + 1
    assert_params_close(model, twin, steps=3)  # seen on AVX2: 1/2 ulp


def test_assigning_a_hyper_parameter_sets_every_group_and_checks_it():
    model, _ = pair()
    opt = AdaLomo(model, lr=LR)
    opt.lr, opt.decay_rate, opt.eps = 0.01, -0.5, [1e-30, 1e-2]
    group = opt.param_groups[0]
    assert (group["lr"], group["decay_rate"], group["eps"]) == (0.01, -0.5, (1e-30, 1e-2))
    with pytest.raises(ValueError, match="decay_rate must be < 0"):
        opt.decay_rate = 0.5
    assert group["decay_rate"] == -0.5


def official_trainer_step(opt, loss, lr):
    """The fp16 step of lomo-optim's official trainer (LOMO's lomo_trainer.py), unchanged."""
    opt.grad_norm(loss)
    if opt.loss_scaler and opt.loss_scaler.has_overflow_serial:
        return "skipped"
    opt.fused_backward(loss, lr)
    return "applied"


def test_official_fp16_loop_runs_unchanged(monkeypatch):
    # lomo_optim's update_scale asks torch.distributed for the rank even in one process.
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a: 0)
    model, twin = pair(torch.float16)
    # From 2**18 the scaled gradients overflow fp16 until the scale is 2**15.
    scale_args = {"init_scale": 2**18, "scale_window": 1000}
    ours = Lomo(model, lr=LR, clip_grad_norm=1.0, loss_scale_args=scale_args)
    theirs = lomo_optim.Lomo(twin, lr=LR, clip_grad_norm=1.0, loss_scale_args=scale_args)
    initial = [p.clone() for p in model.parameters()]
    seen_ours, seen_theirs = [], []
    for step in range(6):
        outcome = official_trainer_step(ours, loss_of(model, step, scale=4.0), LR)
        seen_ours.append((outcome, ours.loss_scaler.loss_scale, ours.loss_scaler.cur_scale))
        outcome = official_trainer_step(theirs, loss_of(twin, step, scale=4.0), LR)
        scaler = theirs.loss_scaler
        seen_theirs.append((outcome, scaler.loss_scale, scaler.cur_scale))
    assert seen_ours == seen_theirs
    assert [o for o, *_ in seen_ours].count("skipped") == 3
    # 3 applied steps in fp16 (seen on AVX2: 4 ulps of the largest parameter in all).
    assert_params_close(model, twin, steps=3)
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), initial, strict=True))


def test_has_overflow_serial_reports_the_step():
    model, _ = pair(torch.float16)
    opt = Lomo(model, lr=LR, loss_scale_args={"init_scale": 2**18})
    assert opt.loss_scaler.has_overflow_serial is False
    before = [p.clone() for p in model.parameters()]
    opt.fused_backward(loss_of(model, 0))  # its own norm pass finds the overflow
    assert opt.loss_scaler.has_overflow_serial is True
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))
    assert opt.loss_scaler.loss_scale == 2**17  # lowered once, not once per pass
    opt.loss_scaler.cur_scale = 2.0**10
    opt.fused_backward(loss_of(model, 1))
    assert opt.loss_scaler.has_overflow_serial is False
    with pytest.raises(ValueError, match="cur_scale"):
        opt.loss_scaler.cur_scale = 0.0
    assert opt.loss_scaler.cur_scale == 2.0**10
