"""A norm pass's measurement serves an update pass only for the loss, clip threshold and loss
scale it was measured at, and a pass that fails leaves nothing of itself to the next step:
each sequence below ends as the same steps without the failed or changed call."""

from __future__ import annotations

import warnings

import pytest
import torch
from support.models import loss_of, mlp
from support.optimizers import OPTIMIZERS
from support.state import same_bits

from lomo_kernels import Lomo


class Interrupted(Exception):
    pass


class _RaisingBackward(torch.autograd.Function):
    """Identity whose backward raises: the gradients below it never arrive."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise Interrupted("midway")


def overflowing_loss_failing_midway(model: torch.nn.Module) -> torch.Tensor:
    """A loss whose last layer gets inf/nan gradients (measured by a norm pass's hooks) and
    whose backward then raises before the first layer's gradients."""
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(7))
    hidden = _RaisingBackward.apply(model[0](x))
    return model[2](model[1](hidden)).float().pow(2).mean() * float("inf")


def outcome(model, opt) -> tuple:
    """The parameters and what the optimizer reports of its last step."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a skipped step warns; compared below instead
        opt.flush_report()
    params = [p.detach().clone() for p in model.parameters()]
    return params, opt.last_step_skipped, opt.last_step_partial, opt.step_count


def assert_same_outcome(a: tuple, b: tuple) -> None:
    assert same_bits(a[0], b[0])
    assert a[1:] == b[1:]


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("nonfinite_a", [False, True], ids=["clean", "nonfinite"])
def test_a_grad_norm_failing_midway_leaves_no_measurement(name, nonfinite_a):
    """grad_norm(A), then a grad_norm(B) that measures inf gradients and raises midway, then
    fused_backward(A): A's step as without B (it measures A again), not skipped on B's flags
    nor applied on A's stale ones."""

    def run(fail_between: bool) -> tuple:
        model = mlp()
        opt = OPTIMIZERS[name](model, lr=0.1, clip_grad_norm=1.0)
        loss_a = loss_of(model, 1)
        if nonfinite_a:
            loss_a = loss_a + model[0].bias[0] * float("nan")
        opt.grad_norm(loss_a)
        if fail_between:
            with pytest.raises(Interrupted):
                opt.grad_norm(overflowing_loss_failing_midway(model))
        opt.fused_backward(loss_a)
        return outcome(model, opt)

    expected = run(fail_between=False)
    assert expected[1] is nonfinite_a  # skipped exactly when A overflows
    assert_same_outcome(run(fail_between=True), expected)


def test_an_update_pass_failing_after_an_overflow_ends_the_attempt():
    """fp16: a step whose norm pass overflows (the scale is lowered at once, as lomo-optim
    does) and whose update pass then raises; each later overflowing step lowers the scale
    again, as when the first step did not raise."""

    def scales(interrupt: bool) -> list[float]:
        model = mlp().half()
        opt = Lomo(model, lr=0.01)
        seen = []
        for step in range(3):
            loss = loss_of(model, step) * 1e30  # overflows fp16 at any scale
            if interrupt and step == 0:
                calls = []

                def hook(grad, calls=calls):
                    calls.append(1)
                    if len(calls) == 2:  # the update pass; the norm pass is the first
                        raise Interrupted("update pass")

                loss.register_hook(hook)
                with pytest.raises(Interrupted):
                    opt.fused_backward(loss)
            else:
                opt.fused_backward(loss)
            seen.append(opt.loss_scaler.cur_scale)
        return seen

    expected = scales(interrupt=False)
    assert expected == [2.0**15, 2.0**14, 2.0**13]
    assert scales(interrupt=True) == expected


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("new_scale", [2.0**40, 2.0**10], ids=["overflows", "fits"])
def test_a_loss_scale_set_after_grad_norm_is_measured_again(name, new_scale):
    """fp16: grad_norm(loss) at one scale, then the caller sets another (lomo-optim's
    `loss_scaler.cur_scale`, AdaLomo's `loss_scale`) before fused_backward(loss). The update
    pass scales by the new one, so the step is the one fused_backward gives at that scale
    alone: an overflow there is found and the step skipped (it was applied unchecked and
    reported clean), a scale that fits steps as usual."""

    def set_scale(opt) -> None:
        if isinstance(opt, Lomo):
            opt.loss_scaler.cur_scale = new_scale
        else:
            opt.loss_scale = new_scale

    def run(grad_norm_first: bool) -> tuple:
        model = mlp().half()
        opt = OPTIMIZERS[name](model, lr=0.01)
        loss = loss_of(model, 0)
        if grad_norm_first:
            opt.grad_norm(loss)
        set_scale(opt)
        opt.fused_backward(loss)
        return outcome(model, opt)

    expected = run(grad_norm_first=False)
    assert expected[1] is (new_scale == 2.0**40)
    assert_same_outcome(run(grad_norm_first=True), expected)
