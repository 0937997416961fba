"""The optimizer's hooks: removed by detach(), a with block or collection; one owner."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from support.models import batch, loss_of, mlp, tiny_llama
from support.optimizers import OPTIMIZERS
from support.state import assert_refused

from lomo_kernels import AdaLomo, Lomo
from lomo_kernels.optim.validation import refuse_shared_memory


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


@pytest.mark.parametrize("options", [{}, {"clip_grad_norm": 1.0, "single_backward": True}])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_dropped_optimizer_leaves_at_once(name, options):
    """No part of an optimizer refers back to it: dropping the last reference frees it
    (reference counting, no collector run), so a new optimizer on the same model is not
    refused."""
    model = mlp()
    gc.disable()
    try:
        opt = OPTIMIZERS[name](model, lr=0.1, **options)
        opt.fused_backward(loss_of(model, 0))
        opt.load_state_dict(opt.state_dict())
        collected = weakref.ref(opt)
        del opt
        assert collected() is None
        OPTIMIZERS[name](model, lr=0.1, **options).fused_backward(loss_of(model, 1))
    finally:
        gc.enable()


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


def replace_with_frozen(model):
    model[2].weight = torch.nn.Parameter(model[2].weight.detach().clone(), requires_grad=False)


def transpose_data(model):
    model[2].weight.data = model[2].weight.data.t().contiguous().t()


def cast(model):
    model.half()


def resize(model):
    model[2].weight.data = model[2].weight.data[:-1].clone()


CHANGES = {
    "unfrozen": (unfreeze, "'0.bias' is trainable but has no hook"),
    "frozen": (freeze, "was frozen"),
    "replaced": (replace, "'2.weight' is trainable but has no hook"),
    "replaced_frozen": (replace_with_frozen, r"'2.weight' is no longer in the model \(replaced\)"),
    "non_contiguous": (transpose_data, "no longer contiguous"),
    "cast": (cast, "was torch.float32"),
    "resized": (resize, r"'2.weight' was of shape \(3, 8\) and is now \(2, 8\)"),
}


@pytest.mark.parametrize(
    ("call", "accumulation_steps"),
    [("fused_backward", 1), ("grad_norm", 1), ("fused_backward", 3)],
    ids=["fused_backward", "grad_norm", "mid-accumulation"],
)
@pytest.mark.parametrize("change", CHANGES)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_parameters_changed_since_construction_refused_before_backward(
    name, change, call, accumulation_steps
):
    # In the middle of an accumulated step too: the micro-batch already accumulated stays
    # pending, and the call's lr is not taken.
    model = mlp()
    model[0].bias.requires_grad_(False)
    opt = OPTIMIZERS[name](model, lr=0.1, accumulation_steps=accumulation_steps)
    opt.fused_backward(loss_of(model, 0))
    edit, match = CHANGES[change]
    loss = loss_of(model, 1)
    edit(model)
    call_with_lr = {"fused_backward": lambda: opt.fused_backward(loss, 0.7),
                    "grad_norm": lambda: opt.grad_norm(loss)}[call]  # fmt: skip
    assert_refused(model, opt, call_with_lr, RuntimeError, match)
    refused = pytest.raises(RuntimeError, getattr(opt, call), loss)
    assert "build a new optimizer" in str(refused.value)
    assert opt.pending_micro_batches == (accumulation_steps > 1)
    assert [g["lr"] for g in opt.param_groups] == [0.1]


@pytest.mark.parametrize("call", ["fused_backward", "grad_norm"])
@pytest.mark.parametrize("second", OPTIMIZERS)
@pytest.mark.parametrize("first", OPTIMIZERS)
def test_two_optimizers_on_parts_of_one_model_refused_before_backward(first, second, call):
    """Each optimizer's backward would reach the other's parameters, whose hooks refuse a
    gradient outside their own step after this one's updates: refused first, by name."""
    model = mlp()
    model[2].requires_grad_(False)
    opt = OPTIMIZERS[first](model, lr=0.1)  # the first layer
    model[0].requires_grad_(False)
    model[2].requires_grad_(True)
    other = OPTIMIZERS[second](model, lr=0.1)  # the last layer
    model[0].requires_grad_(True)
    loss = loss_of(model, 0)
    match = "'2.weight' is trainable in the model .* another live optimizer's hooks update it"
    assert_refused(model, opt, lambda: getattr(opt, call)(loss), RuntimeError, match)
    other.detach()


@pytest.mark.parametrize(
    ("trained", "frozen", "overlap"),
    [
        ([(0, 16)], [(8, 24)], True),  # a frozen view half over a trained one
        ([(0, 16)], [(16, 32)], False),  # adjacent, disjoint
        ([(40, 48)], [(0, 32), (4, 8)], False),  # frozen views over each other only
        ([(0, 50)], [(5, 100), (20, 30)], True),  # the inner frozen view is in the trained one
        ([(10, 20), (0, 5)], [], False),  # trained views out of order, disjoint
        ([(0, 64), (60, 70)], [], True),
    ],
)
def test_shared_memory_spans(trained, frozen, overlap) -> None:
    # Views of one buffer as Parameters, trained or frozen: any overlap with a trained span is
    # refused, wherever the spans sort; frozen spans may overlap each other.
    flat = torch.zeros(128)
    views = [[torch.nn.Parameter(flat[a:b]) for a, b in spans] for spans in (trained, frozen)]
    names = {id(p): f"p{k}" for k, p in enumerate(views[0] + views[1])}
    if overlap:
        with pytest.raises(ValueError, match="share memory but are different Parameters"):
            refuse_shared_memory(views[0], views[1], names)
    else:
        refuse_shared_memory(views[0], views[1], names)


def test_shared_memory_spans_are_compared_within_a_device() -> None:
    # Addresses mean something on their own device only: a span on another device (meta
    # tensors here, every one at address 0) overlaps none on the CPU, and an overlap on its
    # own device is found after the CPU's spans, trained over trained or frozen over trained.
    cpu = torch.nn.Parameter(torch.zeros(8))
    meta = [torch.nn.Parameter(torch.zeros(8, device="meta")) for _ in range(2)]
    labels = ["cpu", "meta0", "meta1"]
    names = {id(p): name for p, name in zip([cpu, *meta], labels, strict=True)}
    refuse_shared_memory([cpu], meta[:1], names)
    refuse_shared_memory([cpu, meta[0]], [], names)
    for trained, frozen in (([cpu, *meta], []), ([cpu, meta[0]], meta[1:])):
        with pytest.raises(ValueError, match="'meta0' and 'meta1' share memory"):
            refuse_shared_memory(trained, frozen, names)


def square_layers(flat: torch.Tensor | None = None) -> torch.nn.Module:
    """Two 4 x 4 layers; with `flat`, their weights are disjoint views of it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
    if flat is not None:
        with torch.no_grad():
            flat.copy_(torch.cat([model[0].weight.flatten(), model[2].weight.flatten()]))
        model[0].weight = torch.nn.Parameter(flat[:16].view(4, 4))
        model[2].weight = torch.nn.Parameter(flat[16:].view(4, 4))
    return model


def square_loss(model: torch.nn.Module) -> torch.Tensor:
    return model(torch.randn(3, 4, generator=torch.Generator().manual_seed(0))).pow(2).mean()


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_parameters_sharing_memory_refused_at_construction(name):
    """Two Parameters over the same memory: the hook of one would update it while the
    backward still reads the other for an earlier layer's gradient. Disjoint views of one
    buffer are served (one step against torch.optim.SGD, within fp32 rounding)."""
    model = square_layers()
    model[2].weight = torch.nn.Parameter(model[0].weight)
    with pytest.raises(ValueError, match="'0.weight' and '2.weight' share memory"):
        OPTIMIZERS[name](model, lr=0.1)
    # A frozen Parameter over a trained one's memory, either layer frozen: the same hazard.
    for frozen in (0, 2):
        model = square_layers()
        model[2].weight = torch.nn.Parameter(model[0].weight)
        model[frozen].weight.requires_grad_(False)
        with pytest.raises(ValueError, match="'0.weight' and '2.weight' share memory"):
            OPTIMIZERS[name](model, lr=0.1)
    # Frozen Parameters may share memory among themselves: nothing writes it.
    model = square_layers()
    model[2].weight = torch.nn.Parameter(model[0].weight)
    model[0].weight.requires_grad_(False)
    model[2].weight.requires_grad_(False)
    OPTIMIZERS[name](model, lr=0.1).detach()
    square_loss(model).backward()  # no hook left behind to refuse a plain backward
    ours, ref = square_layers(torch.zeros(32)), square_layers()
    OPTIMIZERS["lomo"](ours, lr=0.5).fused_backward(square_loss(ours))
    reference = torch.optim.SGD(ref.parameters(), lr=0.5)
    start = [p.detach().clone() for p in ref.parameters()]
    square_loss(ref).backward()
    reference.step()
    # The same fp32 p - lr * g, values and updates below 1: each side rounds lr * g and the
    # difference (half an ulp below 1 each, 2^-25), at most 4 * 2^-25 = 2^-23 apart.
    for a, b, s in zip(ours.parameters(), ref.parameters(), start, strict=True):
        assert b.abs().max() < 1 and (b - s).abs().max() < 1
        torch.testing.assert_close(a, b, rtol=0, atol=2.0**-23)
