"""A step is either correct or refused before any parameter or state tensor changes."""

from __future__ import annotations

import pytest
import torch
from tiny_models import batch, tiny_llama

from lomo_kernels import AdaLomo, Lomo

OPTIMIZERS = {"lomo": Lomo, "adalomo": AdaLomo}


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def loss_of(model: torch.nn.Module, step: int) -> torch.Tensor:
    if isinstance(model, torch.nn.Sequential):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step))
        return model(x).pow(2).mean()
    return model(**batch(step)).loss


MODELS = {"llama": tiny_llama, "mlp": mlp}


def tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter and optimizer state tensor (moments, loss scale), cloned."""
    found = [p.detach().clone() for p in model.parameters()]
    for state in opt.state.values():
        found += [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]
    scaler = getattr(opt, "loss_scaler", None)
    if scaler is not None:
        found += [scaler.scale.clone(), scaler.cur_iter.clone()]
    return found


def same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        for x, y in zip(a, b, strict=True)
    )


def assert_refused(model, opt, call, error, match):
    before = tensors(model, opt)
    with pytest.raises(error, match=match):
        call()
    assert same_bits(before, tensors(model, opt))


# ------------------------------------------------------------------ norm of another loss


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("clip", [None, 0.05], ids=["no_clip", "clip_norm"])
def test_norm_of_another_loss_is_not_reused(name, model_name, clip):
    """grad_norm(loss_a) then fused_backward(loss_b) applies exactly fused_backward(loss_b)."""

    def run(measure_other_loss: bool) -> list[torch.Tensor]:
        model = MODELS[model_name]()
        opt = OPTIMIZERS[name](model, lr=0.05, clip_grad_norm=clip)
        loss_a, loss_b = loss_of(model, 0), loss_of(model, 1)
        if measure_other_loss:
            opt.grad_norm(loss_a)
        opt.fused_backward(loss_b)
        return tensors(model, opt)

    assert same_bits(run(True), run(False))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_norm_pass_for_the_same_loss_is_used_once(name, monkeypatch):
    model = mlp()
    opt = OPTIMIZERS[name](model, lr=0.05, clip_grad_norm=0.05)
    calls = []
    measure = opt.grad_norm
    monkeypatch.setattr(opt, "grad_norm", lambda loss: calls.append(loss) or measure(loss))
    loss = loss_of(model, 0)
    opt.grad_norm(loss)
    opt.fused_backward(loss)
    assert len(calls) == 1
