"""The optimizer's hooks: removed by detach(), a with block or collection; one owner."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from test_optimizer_state_validation import OPTIMIZERS, assert_refused, loss_of, mlp
from tiny_models import batch, tiny_llama

from lomo_kernels import AdaLomo, Lomo


def trains_with(model, make_optimizer) -> None:
    """One plain backward + step of another optimizer changes the model."""
    before = [p.detach().clone() for p in model.parameters()]
    other = make_optimizer(model.parameters())
    other.zero_grad()
    loss_of(model, 7).backward()
    other.step()
    assert all(p.grad is not None for p in model.parameters())
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def adamw(params):
    return torch.optim.AdamW(params, lr=0.01)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_detach_leaves_a_model_any_optimizer_trains(name):
    model = mlp()
    opt = OPTIMIZERS[name](model, lr=0.1)
    opt.fused_backward(loss_of(model, 0))
    opt.detach()
    opt.detach()  # a second call does nothing
    assert not opt.attached
    trains_with(model, sgd)
    with pytest.raises(RuntimeError, match="was detached"):
        opt.fused_backward(loss_of(model, 1))
    OPTIMIZERS[name](model, lr=0.1).fused_backward(loss_of(model, 2))  # a new one may attach


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_with_block_detaches_on_exit(name):
    model = tiny_llama()
    with OPTIMIZERS[name](model, lr=0.1) as opt:
        assert opt.attached
        opt.fused_backward(model(**batch(0)).loss)
    assert not opt.attached
    model(**batch(1)).loss.backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_collected_optimizer_removes_its_hooks(name):
    model = mlp()
    opt = OPTIMIZERS[name](model, lr=0.1, clip_grad_norm=1.0)
    opt.fused_backward(loss_of(model, 0))
    collected = weakref.ref(opt)
    del opt
    gc.collect()
    assert collected() is None
    trains_with(model, adamw)


@pytest.mark.parametrize("first", OPTIMIZERS)
@pytest.mark.parametrize("second", OPTIMIZERS)
def test_second_optimizer_on_owned_parameters_refused(first, second):
    model = mlp()
    opt = OPTIMIZERS[first](model, lr=0.1)
    with pytest.raises(ValueError, match=r"already updated in backward.*detach\(\)"):
        OPTIMIZERS[second](model.get_submodule("2"))
    opt.fused_backward(loss_of(model, 0))  # the first one is untouched and still works
    opt.detach()
    OPTIMIZERS[second](model)


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda m: Lomo(m, backend="nonexistent"), "unknown lomo_kernels backend 'nonexistent'"),
        (lambda m: AdaLomo(m, backend="nonexistent"), "unknown lomo_kernels backend 'nonexistent'"),
        (
            lambda m: Lomo(m.half(), loss_scale_args={"init_scale": -1.0}),
            "init_scale must be finite and > 0",
        ),
    ],
    ids=["lomo_backend", "adalomo_backend", "lomo_loss_scale"],
)
def test_failed_constructor_leaves_no_hook_and_no_claim(build, match):
    model = mlp()
    with pytest.raises(ValueError, match=match):
        build(model)
    model.float()
    trains_with(model, sgd)
    Lomo(model)  # nothing claims the parameters


def unfreeze(model):
    model[0].bias.requires_grad_(True)


def freeze(model):
    model[2].weight.requires_grad_(False)


def replace(model):
    model[2].weight = torch.nn.Parameter(model[2].weight.detach().clone())


def transpose_data(model):
    model[2].weight.data = model[2].weight.data.t().contiguous().t()


def cast(model):
    model.half()


CHANGES = {
    "unfrozen": (unfreeze, "has no hook"),
    "frozen": (freeze, "was frozen"),
    "replaced": (replace, "has no hook"),
    "non_contiguous": (transpose_data, "no longer contiguous"),
    "cast": (cast, "was torch.float32"),
}


@pytest.mark.parametrize("call", ["fused_backward", "grad_norm"])
@pytest.mark.parametrize("change", CHANGES)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_parameters_changed_since_construction_refused_before_backward(name, change, call):
    model = mlp()
    model[0].bias.requires_grad_(False)
    opt = OPTIMIZERS[name](model, lr=0.1)
    opt.fused_backward(loss_of(model, 0))
    edit, match = CHANGES[change]
    loss = loss_of(model, 1)
    edit(model)
    assert_refused(model, opt, lambda: getattr(opt, call)(loss), RuntimeError, match)
    refused = pytest.raises(RuntimeError, getattr(opt, call), loss)
    assert "build a new optimizer" in str(refused.value)
