"""A norm pass's measurement serves an update pass only for the loss, clip threshold and loss
scale it was measured at, and a pass that fails leaves nothing of itself to the next step:
each sequence below ends as the same steps without the failed or changed call."""

from __future__ import annotations

import warnings
from unittest import mock

import pytest
import torch
from support.faults import FailingBackward, Interrupted
from support.models import loss_of, mlp
from support.optimizers import OPTIMIZERS
from support.state import same_bits

from lomo_kernels import Lomo


def _raise_midway() -> None:
    raise Interrupted("midway")


def overflowing_loss_failing_midway(model: torch.nn.Module) -> torch.Tensor:
    """A loss whose last layer gets inf/nan gradients (measured by a norm pass's hooks) and
    whose backward then raises before the first layer's gradients."""
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(7)).to(model[0].weight.dtype)
    hidden = FailingBackward.apply(model[0](x), _raise_midway)
    return model[2](model[1](hidden)).float().pow(2).mean() * float("inf")


def loss_scale(opt) -> float | None:
    if isinstance(opt, Lomo):
        return None if opt.loss_scaler is None else opt.loss_scaler.cur_scale
    return opt.loss_scale


def outcome(model, opt) -> tuple:
    """The parameters, what the optimizer reports of its last step, and the loss scale."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a skipped step warns; compared below instead
        opt.flush_report()
    params = [p.detach().clone() for p in model.parameters()]
    return params, opt.last_step_skipped, opt.last_step_partial, opt.step_count, loss_scale(opt)


def assert_same_outcome(a: tuple, b: tuple) -> None:
    assert same_bits(a[0], b[0])
    assert a[1:] == b[1:]


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("nonfinite_a", [False, True], ids=["clean", "nonfinite"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_a_grad_norm_failing_midway_leaves_no_measurement(name, nonfinite_a, dtype):
    """grad_norm(A), then a grad_norm(B) that measures inf gradients and raises midway, then
    fused_backward(A): A's step as without B (it measures A again), not skipped on B's flags
    nor applied on A's stale ones; in fp16 the failed pass starts no attempt, so A's
    overflow lowers Lomo's scale once, as without B."""

    def run(fail_between: bool) -> tuple:
        model = mlp().to(dtype)
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


def test_a_scale_set_after_a_failed_grad_norm_starts_the_attempt_anew():
    """fp16: grad_norm(A) overflows (the scale lowered once), a grad_norm(B) fails midway,
    the caller sets the scale back up, and fused_backward(A) overflows there: the scale is
    lowered from the value set, as without B."""

    def run(fail_between: bool) -> tuple:
        model = mlp().half()
        opt = Lomo(model, lr=0.01)
        loss_a = loss_of(model, 0) * 1e30  # overflows fp16 at any scale
        opt.grad_norm(loss_a)
        if fail_between:
            with pytest.raises(Interrupted):
                opt.grad_norm(overflowing_loss_failing_midway(model))
        opt.loss_scaler.cur_scale = 2.0**16
        opt.fused_backward(loss_a)
        return outcome(model, opt)

    expected = run(fail_between=False)
    assert expected[1] and expected[-1] == 2.0**15
    assert_same_outcome(run(fail_between=True), expected)


@pytest.mark.parametrize("k", [1, 2], ids=["update_pass", "apply_from_the_buffers"])
def test_an_update_failing_after_an_overflow_ends_the_attempt(k):
    """fp16: a step whose gradients overflow (a norm pass, or the micro-batches, find it and
    lower the scale at once, as lomo-optim does) and whose update then raises: the update
    pass (`k` = 1), or the step applied from the buffers (`k` = 2 micro-batches); each later
    overflowing step lowers the scale again, as when the first step did not raise."""

    def scales(interrupt: bool) -> list[float]:
        model = mlp().half()
        opt = Lomo(model, lr=0.01, accumulation_steps=k)
        seen = []
        for step in range(3):
            for micro_batch in range(k - 1):
                opt.fused_backward(loss_of(model, k * step + micro_batch) * 1e30)
            last = loss_of(model, k * step + k - 1) * 1e30  # overflows fp16 at any scale
            if interrupt and step == 0:
                failing = mock.patch.object(opt, "_update_whole", side_effect=Interrupted("x"))
                with failing, pytest.raises(Interrupted):
                    opt.fused_backward(last)
            else:
                opt.fused_backward(last)
            seen.append(opt.loss_scaler.cur_scale)
        return seen

    expected = scales(interrupt=False)
    assert expected == [2.0**15, 2.0**14, 2.0**13]
    assert scales(interrupt=True) == expected


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize(
    ("new_scale", "factor"),
    [(2.0**40, 1.0), (2.0**10, 1.0), (2.0**10, 1e30)],
    ids=["overflows", "fits", "overflows-at-both"],
)
def test_a_loss_scale_set_after_grad_norm_is_measured_again(name, new_scale, factor):
    """fp16: grad_norm(loss) at one scale, then the caller sets another (lomo-optim's
    `loss_scaler.cur_scale`, AdaLomo's `loss_scale`) before fused_backward(loss). The update
    pass scales by the new one, so the step is the one fused_backward gives at that scale
    alone: an overflow there is found and the step skipped (it was applied unchecked and
    reported clean), and lowers Lomo's scale from the value set, also where grad_norm's
    overflow had lowered it already (`factor`: a loss that overflows at any scale); a scale
    that fits steps as usual."""

    def set_scale(opt) -> None:
        if isinstance(opt, Lomo):
            opt.loss_scaler.cur_scale = new_scale
        else:
            opt.loss_scale = new_scale

    def run(grad_norm_first: bool) -> tuple:
        model = mlp().half()
        opt = OPTIMIZERS[name](model, lr=0.01)
        loss = loss_of(model, 0) * factor
        if grad_norm_first:
            opt.grad_norm(loss)
        set_scale(opt)
        opt.fused_backward(loss)
        return outcome(model, opt)

    expected = run(grad_norm_first=False)
    assert expected[1] is (new_scale == 2.0**40 or factor > 1)
    assert_same_outcome(run(grad_norm_first=True), expected)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_fused_backward_refused_by_the_graph_leaves_the_measurement(name):
    """grad_norm(A), then fused_backward(B) refused before any change by the read of its
    graph (a sparse gradient), then fused_backward(A): A's measurement still serves it (one
    norm pass in all) and is the one reported, as without the refused call."""

    def run(refused_between: bool) -> tuple:
        model = mlp()
        opt = OPTIMIZERS[name](model, lr=0.1)
        passes = []
        loss_a = loss_of(model, 0)
        loss_a.register_hook(lambda grad: passes.append(1))
        opt.grad_norm(loss_a)
        if refused_between:
            rows = torch.tensor([[0, 1], [2, 3]])
            sparse = torch.gather(model[0].weight, 0, rows, sparse_grad=True).sum()
            with pytest.raises(ValueError, match="sparse"):
                opt.fused_backward(sparse)
        opt.fused_backward(loss_a)
        return (*outcome(model, opt), float(opt.last_grad_norm), len(passes))

    expected = run(refused_between=False)
    assert expected[-1] == 2  # a norm pass and the update pass
    assert_same_outcome(run(refused_between=True), expected)


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("refusal", ["non_scalar", "inference_mode"])
def test_a_refused_grad_norm_leaves_the_earlier_measurement(name, refusal):
    """fp16, a loss that overflows: grad_norm(A) (Lomo's scale lowered once), a grad_norm
    refused before its pass, then fused_backward(A): A's measurement serves it (one norm
    pass in all, no second lowering of the scale), as without the refused call."""

    def run(refused_between: bool) -> tuple:
        model = mlp().half()
        opt = OPTIMIZERS[name](model, lr=0.01)
        passes = []
        loss_a = loss_of(model, 0) * 1e30
        loss_a.register_hook(lambda grad: passes.append(1))
        opt.grad_norm(loss_a)
        if refused_between and refusal == "non_scalar":
            with pytest.raises(ValueError, match="scalar"):
                opt.grad_norm(torch.stack([loss_of(model, 1), loss_of(model, 2)]))
        elif refused_between:
            with torch.inference_mode(), pytest.raises(RuntimeError, match="inference_mode"):
                opt.grad_norm(loss_a)
        opt.fused_backward(loss_a)
        return (*outcome(model, opt), len(passes))

    expected = run(refused_between=False)
    assert expected[1] and expected[-1] == 2  # skipped; a norm pass and the update pass
    assert_same_outcome(run(refused_between=True), expected)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_an_overflow_measured_of_another_loss_does_not_skip_an_unclipped_step(name):
    """grad_norm(A) measures inf/nan gradients, then fused_backward(B) of another loss
    without clipping in fp32 (a step that needs no norm pass, so measures none): B's step as
    without the grad_norm, applied, not skipped on A's flag."""

    def run(measure_first: bool) -> tuple:
        model = mlp()
        opt = OPTIMIZERS[name](model, lr=0.1)
        if measure_first:
            opt.grad_norm(loss_of(model, 0) * float("inf"))
        opt.fused_backward(loss_of(model, 1))
        return outcome(model, opt)

    expected = run(measure_first=False)
    assert expected[1:3] == (False, False)  # neither skipped nor partial
    assert_same_outcome(run(measure_first=True), expected)
