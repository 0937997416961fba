"""Misuse of the optimizer object itself, refused with a clear error before any change:
a copy or pickle (it holds no hooks), a step under ``torch.inference_mode()``, and a
`step_count` that is no count."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from support.models import loss_of, mlp
from support.optimizers import OPTIMIZERS
from support.state import assert_refused, same_bits, tensors

MODES = {
    "plain": {},
    "clip_norm": {"clip_grad_norm": 1.0},
    "accumulation": {"accumulation_steps": 2},
}


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("copier", [copy.deepcopy, copy.copy, pickle.dumps])
def test_a_copy_or_pickle_is_refused(name, copier):
    """A copy would hold no hooks on the model and fail at its first use: refused, naming
    what to do; the optimizer itself steps on."""
    model = mlp()
    opt = OPTIMIZERS[name](model, lr=0.1)
    with pytest.raises(TypeError, match=r"cannot be copied or pickled.*state_dict"):
        copier(opt)
    before = [p.detach().clone() for p in model.parameters()]
    opt.fused_backward(loss_of(model, 0))
    assert not any(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("first_step_inside", [True, False], ids=["first", "later"])
def test_a_step_under_inference_mode_is_refused(name, mode, first_step_inside):
    """Under inference_mode a step's tensors (device scalars, buffers) would be inference
    tensors that no later step outside it may write. Refused before any change, at the first
    step or a later one, and the optimizer then steps outside exactly as one never called
    inside."""
    model, reference = mlp(), mlp()
    opt = OPTIMIZERS[name](model, lr=0.1, **MODES[mode])
    expected = OPTIMIZERS[name](reference, lr=0.1, **MODES[mode])
    steps = 0 if first_step_inside else 2
    for step in range(steps):
        opt.fused_backward(loss_of(model, step))
        expected.fused_backward(loss_of(reference, step))
    loss = loss_of(model, steps)

    def inside() -> None:
        with torch.inference_mode():
            opt.fused_backward(loss, lr=0.5)

    assert_refused(model, opt, inside, RuntimeError, r"under torch\.inference_mode\(\)")
    for step in range(steps, steps + 2):
        opt.fused_backward(loss_of(model, step))
        expected.fused_backward(loss_of(reference, step))
    assert same_bits(list(model.parameters()), list(reference.parameters()))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_step_applying_the_buffers_under_inference_mode_is_refused(name):
    model = mlp()
    opt = OPTIMIZERS[name](model, lr=0.1, accumulation_steps=3)
    opt.fused_backward(loss_of(model, 0))

    def inside() -> None:
        with torch.inference_mode():
            opt.step()

    assert_refused(model, opt, inside, RuntimeError, r"under torch\.inference_mode\(\)")
    assert opt.pending_micro_batches == 1
    opt.step()  # outside: applied
    assert opt.pending_micro_batches == 0 and opt.step_count == 1


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_constructor_under_inference_mode_is_refused_and_leaves_no_hook(name):
    model = mlp()
    with torch.inference_mode(), pytest.raises(RuntimeError, match="inference_mode"):
        OPTIMIZERS[name](model, lr=0.1)
    loss_of(model, 0).backward()  # no hook of a half-built optimizer refuses it
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize(
    ("value", "error"),
    [(-1, ValueError), (1.5, TypeError), ("3", TypeError), (None, TypeError), (True, TypeError)],
)
def test_step_count_takes_only_a_count(name, value, error):
    """step_count is settable (lomo-optim's trainers set it on resume) and read by the next
    step (AdaLomo's beta2, the rounding seed): a value that is no int >= 0 is refused as it
    is set, as load_state_dict refuses it, not at the next step."""
    model = mlp()
    opt = OPTIMIZERS[name](model, lr=0.1)
    opt.fused_backward(loss_of(model, 0))
    with pytest.raises(error, match="step_count must be an int >= 0"):
        opt.step_count = value
    assert opt.step_count == 1
    opt.step_count = 7
    opt.fused_backward(loss_of(model, 1))
    assert opt.step_count == 8


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_step_count_set_is_the_next_steps(name):
    """bf16 weights (stochastic rounding): after one step, step_count = 7 makes the next step
    step 8 (AdaLomo's beta2, the rounding's seed), the same as a checkpoint saying 7 loaded
    into the optimizer, and other than the step 2 the count would have made."""

    def second_step(count: int | None, by_checkpoint: bool = False) -> list[torch.Tensor]:
        model = mlp().to(torch.bfloat16)
        opt = OPTIMIZERS[name](model, lr=0.1)
        opt.fused_backward(loss_of(model, 0))
        if count is not None and by_checkpoint:
            saved = opt.state_dict()
            for entry in (saved["lomo"], *(group["lomo"] for group in saved["param_groups"])):
                entry["step_count"] = count
            opt.load_state_dict(saved)
        elif count is not None:
            opt.step_count = count
        opt.fused_backward(loss_of(model, 1))
        return tensors(model, opt)

    set_by_hand = second_step(7)
    assert same_bits(set_by_hand, second_step(7, by_checkpoint=True))
    assert not same_bits(set_by_hand, second_step(None))
