"""Lomo / AdaLomo built the way torch optimizers are (an iterable of parameters,
``named_parameters()``, param-group dicts) as well as from the model (lomo-optim's form):
the same steps, the same checks, and every message naming the parameter."""

from __future__ import annotations

import pytest
import torch
from support.models import batch, clone, tiny_llama
from support.optimizers import OPTIMIZERS
from support.state import assert_unchanged_since, optimizer_snapshot, same_bits

import lomo_kernels
from lomo_kernels import Lomo

OPTIONS = {"lr": 0.05, "clip_grad_norm": 1.0, "weight_decay": 0.01, "seed": 3}


def decay_split(model):
    decay = [p for n, p in model.named_parameters() if n.endswith("proj.weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("proj.weight")]
    return decay, rest


FORMS = {
    "parameters": lambda m: m.parameters(),
    "list": lambda m: list(m.parameters()),
    "named_parameters": lambda m: m.named_parameters(),
    "groups": lambda m: [
        {"params": decay_split(m)[0]},
        {"params": decay_split(m)[1], "weight_decay": 0.0},
    ],
}


def trained(opt, model, steps=2):
    for step in range(steps):
        opt.fused_backward(model(**batch(step)).loss)
    return model


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("form", FORMS)
def test_each_form_steps_as_the_model_form(name, form):
    """Bit for bit the model form's steps, the groups form against ``param_groups=`` with
    the same groups: bf16 weights (stochastic rounding, same seed) for the flat forms, fp32
    for the groups (a parameter's rounding bits are keyed by its position, which the groups'
    order sets: decay first here, where the model interleaves them)."""
    start = tiny_llama(torch.float32 if form == "groups" else torch.bfloat16)
    reference = clone(start)
    groups = None
    if form == "groups":
        decay, rest = decay_split(reference)
        groups = [{"params": decay}, {"params": rest, "weight_decay": 0.0}]
    trained(OPTIMIZERS[name](reference, param_groups=groups, **OPTIONS), reference)
    model = clone(start)
    opt = OPTIMIZERS[name](FORMS[form](model), **OPTIONS)
    trained(opt, model)
    assert same_bits(list(model.parameters()), list(reference.parameters()))
    assert [g["weight_decay"] for g in opt.param_groups] == (
        [0.01, 0.0] if form == "groups" else [0.01]
    )


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_state_dict_moves_between_forms(name):
    model = tiny_llama()
    opt = OPTIMIZERS[name](model, **OPTIONS)
    trained(opt, model)
    resumed = clone(model)
    other = OPTIMIZERS[name](resumed.parameters(), **OPTIONS)
    other.load_state_dict(opt.state_dict())
    trained(opt, model, steps=1)
    trained(other, resumed, steps=1)
    assert same_bits(list(model.parameters()), list(resumed.parameters()))


def test_frozen_and_repeated_tensors_count_as_in_the_model_form():
    model = tiny_llama()
    model.model.norm.weight.requires_grad_(False)
    params = list(model.parameters())
    opt = Lomo(params + params[:2], lr=0.05)  # listed twice: stepped once
    assert sum(len(g["params"]) for g in opt.param_groups) == len(params) - 1
    frozen = model.model.norm.weight.detach().clone()
    trained(opt, model, steps=1)
    assert torch.equal(model.model.norm.weight, frozen)
    # torch's group keys: one tensor as "params", and "param_names"
    opt.detach()
    head = model.lm_head.weight
    named = Lomo([{"params": head, "param_names": ["head"]}], lr=0.05)
    assert named.param_groups[0]["params"] == [head]
    named.detach()


NAMES = [n for n, _ in tiny_llama().named_parameters()]
UP_PROJ = NAMES.index("model.layers.0.mlp.up_proj.weight")
NORM = NAMES.index("model.norm.weight")


def _bad_dtype(model):
    weight = model.model.layers[0].mlp.up_proj.weight
    weight.data = weight.data.double()


# (the argument given, the exception, the message)
REFUSED = {
    "empty": (lambda m: [], ValueError, "empty parameter list"),
    "one_tensor": (lambda m: m.lm_head.weight, TypeError, r"one tensor: pass \[tensor\]"),
    "not_a_tensor": (lambda m: [m.lm_head.weight, 3], TypeError, "holds a int at position 1"),
    "mixed": (
        lambda m: [{"params": [m.lm_head.weight]}, m.model.norm.weight],
        TypeError,
        "mixed with tensors",
    ),
    "not_a_leaf": (lambda m: [m.lm_head.weight * 2], ValueError, "'param_0' is not a leaf"),
    "group_without_params": (
        lambda m: [{"params": [m.lm_head.weight]}, {"lr": 0.1}],
        TypeError,
        "param group 1 has no 'params'",
    ),
    "group_params_a_dict": (
        lambda m: [{"params": {"w": m.lm_head.weight}}],
        TypeError,
        r"param group 0\['params'\] must be parameters or \(name, parameter\) pairs, got dict",
    ),
    "param_names_short": (
        lambda m: [{"params": [m.lm_head.weight, m.model.norm.weight], "param_names": ["head"]}],
        ValueError,
        r"param group 0\['param_names'\] must name each of its 2 parameters",
    ),
    "param_names_not_strings": (
        lambda m: [{"params": [m.lm_head.weight], "param_names": [0]}],
        ValueError,
        "must name each of its 1 parameters",
    ),
    "group_params_a_number": (
        lambda m: [{"params": 3}],
        TypeError,
        r"param group 0\['params'\] must be parameters or .* got int",
    ),
    "two_groups": (
        lambda m: [{"params": [m.lm_head.weight]}, {"params": [m.lm_head.weight]}],
        ValueError,
        "'param_1', already in param_groups\\[0\\]",
    ),
    "unknown_key": (
        lambda m: [{"params": [m.lm_head.weight], "momentum": 0.9}],
        ValueError,
        "sets \\['momentum'\\]",
    ),
    "bad_value": (
        lambda m: [{"params": [m.lm_head.weight], "lr": -1.0}],
        ValueError,
        "lr must be",
    ),
    "dtype_named": (
        lambda m: (_bad_dtype(m), m.named_parameters())[1],
        TypeError,
        "'model.layers.0.mlp.up_proj.weight' has dtype torch.float64",
    ),
    "dtype_unnamed": (
        lambda m: (_bad_dtype(m), m.parameters())[1],
        TypeError,
        f"'param_{UP_PROJ}' has dtype torch.float64",
    ),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("case", REFUSED)
def test_refused_at_construction_with_the_parameters_name_and_nothing_left(name, case):
    model = tiny_llama()
    given, error, match = REFUSED[case]
    argument = given(model)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(error, match=match):
        OPTIMIZERS[name](argument, lr=0.05)
    assert same_bits(before, [p.detach() for p in model.parameters()])
    if case not in ("dtype_named", "dtype_unnamed"):
        model(**batch(0)).loss.backward()  # no hook left behind
        assert model.lm_head.weight.grad is not None


def test_param_groups_given_twice_refused():
    model = tiny_llama()
    with pytest.raises(TypeError, match="given twice"):
        Lomo([{"params": list(model.parameters())}], param_groups=[{"params": []}])


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_later_refusals_name_the_given_names(name):
    """A check at the step names the tensor as given: param_<i>, the pair's name, or its
    name in a group's param_names."""
    model = tiny_llama()
    opt = OPTIMIZERS[name](model.parameters(), lr=0.05)
    model.model.norm.weight.requires_grad_(False)
    before = optimizer_snapshot(model, opt)
    with pytest.raises(RuntimeError, match=f"'param_{NORM}' was frozen"):
        opt.fused_backward(model(**batch(0)).loss)
    assert_unchanged_since(before, model, opt)
    opt.detach()
    model.model.norm.weight.requires_grad_(True)
    opt = OPTIMIZERS[name](model.named_parameters(), lr=0.05)
    opt.param_groups[0]["lr"] = float("nan")
    with pytest.raises(ValueError, match="lr must be"):
        opt.fused_backward(model(**batch(0)).loss)
    opt.detach()
    # A group's "param_names" (torch's key) name its tensors.
    head = model.lm_head.weight
    opt = OPTIMIZERS[name]([{"params": [head], "param_names": ["the head"]}], lr=0.05)
    head.requires_grad_(False)
    with pytest.raises(RuntimeError, match="'the head' was frozen"):
        opt.fused_backward(model(**batch(0)).loss)


def test_a_tied_patched_model_given_its_parameters_trains_as_given_the_model():
    """model.parameters() lists a tied head once: the head still takes both contributions
    (materialised), as with the model given."""
    start = lomo_kernels.patch_causal_lm(tiny_llama(tie_word_embeddings=True))
    a, b = clone(start), clone(start)
    trained(Lomo(a, **OPTIONS), a)
    trained(Lomo(b.parameters(), **OPTIONS), b)
    assert same_bits(list(a.parameters()), list(b.parameters()))


def test_dtensors_given_without_the_model_refused(monkeypatch):
    """FSDP2's units are found from the model: its DTensor parameters alone are refused by
    name (the check, with a stand-in for a DTensor)."""
    from lomo_kernels.optim import given_parameters

    model = tiny_llama()
    monkeypatch.setattr(given_parameters, "is_dtensor", lambda t: t is model.lm_head.weight)
    with pytest.raises(
        ValueError, match="'lm_head.weight' is a DTensor \\(FSDP2\\): pass the model"
    ):
        Lomo(model.named_parameters(), lr=0.05)
