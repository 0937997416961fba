"""param_groups=: torch-style groups for Lomo and AdaLomo built from a model."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from support.adalomo import adalomo_f64
from support.float64 import FP32_NORM_RTOL
from support.models import batch, max_rel_diff, tiny_llama

from lomo_kernels import AdaLomo, Lomo
from lomo_kernels.core.ownership import updated_in_backward

STEPS = 4
MAX_NORM = 0.5  # below the tiny LLaMA's gradient norms (about 2-3): every step clips


def no_decay_names(model):
    """transformers' Trainer split on a LLaMA: no decay on the RMSNorm weights."""
    return [name for name, _ in model.named_parameters() if "norm" in name]


def two_groups(model, **no_decay):
    """Our groups by name: the norm weights with their own values, the rest unlisted."""
    return [{"params": no_decay_names(model), "weight_decay": 0.0, **no_decay}]


def torch_groups(model, **no_decay):
    """The same two groups as torch.optim takes them (tensors, the unlisted ones last)."""
    names = set(no_decay_names(model))
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if n in names], "weight_decay": 0.0, **no_decay},
        {"params": [p for n, p in named if n not in names]},
    ]


def halving(step):
    return 0.5**step  # a scheduler factor: both groups' lr change every step


@pytest.mark.parametrize("single_lr", [True, False], ids=["shared-lr", "own-lr"])
def test_lomo_two_groups_equal_torch_sgd(single_lr):
    """Per-group weight decay and lr reach the fused update; clipping stays global."""
    own = {} if single_lr else {"lr": 0.03}
    ours, ref = tiny_llama(), tiny_llama()
    opt = Lomo(
        ours,
        lr=0.1,
        clip_grad_norm=MAX_NORM,
        weight_decay=0.3,
        param_groups=two_groups(ours, **own),
    )
    sgd = torch.optim.SGD(torch_groups(ref, **own), lr=0.1, weight_decay=0.3)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, halving) for o in (opt, sgd)]
    for step in range(STEPS):
        opt.fused_backward(ours(**batch(step)).loss)
        sgd.zero_grad()
        ref(**batch(step)).loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        assert opt.last_grad_norm.item() == pytest.approx(norm.item(), rel=FP32_NORM_RTOL)
        sgd.step()
        for sched in scheds:
            sched.step()
    # Same bound as the one-group comparison with SGD (test_lomo_optimizer.py): fp32 sums
    # in another order; decay on the norm weights would be off by lr * 0.3 (about 1e-2).
    assert max_rel_diff(ours, ref) <= 1e-6
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in sgd.param_groups]


def adalomo_f64_steps(model, groups, steps, lr, weight_decay, start=0, state=None):
    """AdaLomo in float64 on the model's own gradients (torch autograd), the clip coefficient
    from the global norm of all of them; written back to the fp32 parameters each step.
    Steps `start` to `start + steps - 1` from the moments `state`; returns the moments. A
    group may set its own eps, clip_threshold, decay_rate and clip_grad_value (AdaLomo's
    defaults otherwise)."""
    group_of = {id(p): g for g in groups for p in g["params"]}
    state = {} if state is None else state
    for step in range(start, start + steps):
        model.zero_grad(set_to_none=True)
        model(**batch(step)).loss.backward()
        norm = math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in model.parameters()))
        coef = min(1.0, MAX_NORM / (norm + 1e-6))
        with torch.no_grad():
            for p in model.parameters():
                if id(p) not in state:
                    state[id(p)] = (
                        {
                            "exp_avg_sq_row": torch.zeros(p.shape[0]),
                            "exp_avg_sq_col": torch.zeros(p.shape[1]),
                        }
                        if p.dim() >= 2
                        else {"exp_avg_sq": torch.zeros(p.shape)}
                    )
                group = group_of[id(p)]
                beta2 = 1.0 - math.pow(step + 1, group.get("decay_rate", -0.8))
                own = {k: group[k] for k in ("eps", "clip_threshold") if k in group}
                new, state[id(p)], _ = adalomo_f64(
                    p, p.grad, state[id(p)], lr=lr, beta2=beta2, clip_coef=coef,
                    weight_decay=group.get("weight_decay", weight_decay),
                    clip_value=group.get("clip_grad_value"), **own,
                )  # fmt: skip
                p.copy_(new.view_as(p))
    return state


def test_adalomo_two_groups_match_float64():
    ours, ref = tiny_llama(), tiny_llama()
    opt = AdaLomo(
        ours, lr=0.01, clip_grad_norm=MAX_NORM, weight_decay=0.5, param_groups=two_groups(ours)
    )
    for step in range(3):
        opt.fused_backward(ours(**batch(step)).loss)
    adalomo_f64_steps(ref, torch_groups(ref), 3, lr=0.01, weight_decay=0.5)
    # The fp32 kernels' bound (support/adalomo.py: 1e-5 of max(|p|, |update|) per step) over
    # 3 steps; decay on the norm weights would be off by lr * rms(p) * 0.5 (about 5e-3).
    assert max_rel_diff(ours, ref) <= 1e-5


def test_adalomo_group_hyper_parameters_match_float64():
    # A group (the norm weights) with its own eps, clip_threshold, decay_rate and
    # clip_grad_value, each far enough from the defaults to move its parameters by more than
    # the bound; the other parameters keep the constructor's (no value clipping).
    ours, ref = tiny_llama(), tiny_llama()
    own = {"eps": (1e-30, 3e-2), "clip_threshold": 0.05, "decay_rate": -0.5,
           "clip_grad_value": 1e-3}  # fmt: skip
    opt = AdaLomo(ours, lr=0.01, clip_grad_norm=MAX_NORM, param_groups=two_groups(ours, **own))
    for step in range(3):
        opt.fused_backward(ours(**batch(step)).loss)
    adalomo_f64_steps(ref, torch_groups(ref, **own), 3, lr=0.01, weight_decay=0.0)
    # The fp32 kernels' bound over 3 steps, as in test_adalomo_two_groups_match_float64.
    assert max_rel_diff(ours, ref) <= 1e-5
    for name, value in own.items():  # each alone, the defaults else: the bound tells them apart
        alone = tiny_llama()
        adalomo_f64_steps(alone, torch_groups(alone, **{name: value}), 3, lr=0.01,
                          weight_decay=0.0)  # fmt: skip
        assert max_rel_diff(alone, ref) > 1e-4, name


def test_lomo_group_clip_grad_value_equals_torch_sgd():
    # The norm weights' group clamps its gradients at its own clip_grad_value (the others at
    # the constructor's), before the global clip coefficient, which comes from the unclamped
    # gradients (lomo-optim's order): torch's SGD on gradients treated so.
    ours, ref = tiny_llama(), tiny_llama()
    opt = Lomo(ours, lr=0.1, clip_grad_norm=MAX_NORM, clip_grad_value=0.05,
               param_groups=two_groups(ours, clip_grad_value=1e-3))  # fmt: skip
    sgd = torch.optim.SGD(torch_groups(ref), lr=0.1)
    clamp_at = {id(p): 1e-3 for p in sgd.param_groups[0]["params"]}
    for step in range(STEPS):
        opt.fused_backward(ours(**batch(step)).loss)
        sgd.zero_grad()
        ref(**batch(step)).loss.backward()
        grads = [p.grad for p in ref.parameters()]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        coef = torch.clamp(MAX_NORM / (norm + 1e-6), max=1.0)
        for p in ref.parameters():
            v = clamp_at.get(id(p), 0.05)
            p.grad.clamp_(-v, v).mul_(coef)
        sgd.step()
    # The bound of the one-group comparison with SGD (test_lomo_optimizer.py); the group's
    # own threshold moves its parameters by lr * coef * (its gradients beyond 1e-3) more.
    assert max_rel_diff(ours, ref) <= 1e-6
    lax = tiny_llama()
    Lomo(lax, lr=0.1, clip_grad_norm=MAX_NORM, clip_grad_value=0.05).fused_backward(
        lax(**batch(0)).loss
    )
    once = tiny_llama()
    Lomo(once, lr=0.1, clip_grad_norm=MAX_NORM, clip_grad_value=0.05,
         param_groups=two_groups(once, clip_grad_value=1e-3)).fused_backward(
        once(**batch(0)).loss)  # fmt: skip
    assert max_rel_diff(lax, once) > 1e-4  # the group's own threshold acted


def regroup(groups, model):
    """Between steps, as torch.optim allows: the head's weight moves from the last group into
    the first (the no-decay group), then the two groups swap places."""
    head = model.lm_head.weight
    groups[-1]["params"] = [p for p in groups[-1]["params"] if p is not head]
    groups[0]["params"].append(head)
    groups.reverse()


def test_lomo_parameter_moved_between_groups_steps_with_its_new_group():
    """A parameter moved to another group, and groups reordered, after a step: the next step
    uses each parameter's group as it is then, as torch.optim.SGD does (the head keeping its
    old group's lr and decay would be off by about 1e-2)."""
    ours, ref = tiny_llama(), tiny_llama()
    opt = Lomo(ours, lr=0.1, weight_decay=0.3, param_groups=two_groups(ours, lr=0.03))
    sgd = torch.optim.SGD(torch_groups(ref, lr=0.03), lr=0.1, weight_decay=0.3)
    for step in range(2):
        if step == 1:
            regroup(opt.param_groups, ours)
            regroup(sgd.param_groups, ref)
        opt.fused_backward(ours(**batch(step)).loss)
        sgd.zero_grad()
        ref(**batch(step)).loss.backward()
        sgd.step()
    assert max_rel_diff(ours, ref) <= 1e-6  # as test_lomo_two_groups_equal_torch_sgd


def test_adalomo_parameter_moved_between_groups_matches_float64():
    ours, ref = tiny_llama(), tiny_llama()
    opt = AdaLomo(
        ours, lr=0.01, clip_grad_norm=MAX_NORM, weight_decay=0.5, param_groups=two_groups(ours)
    )
    groups = torch_groups(ref)
    opt.fused_backward(ours(**batch(0)).loss)
    state = adalomo_f64_steps(ref, groups, 1, lr=0.01, weight_decay=0.5)
    regroup(opt.param_groups, ours)
    regroup(groups, ref)
    opt.fused_backward(ours(**batch(1)).loss)
    adalomo_f64_steps(ref, groups, 1, lr=0.01, weight_decay=0.5, start=1, state=state)
    # As test_adalomo_two_groups_match_float64; the head decayed by its old group would be
    # off by lr * rms(p) * 0.5 (about 5e-3).
    assert max_rel_diff(ours, ref) <= 1e-5


@pytest.mark.parametrize("cls", [Lomo, AdaLomo], ids=["Lomo", "AdaLomo"])
def test_state_dict_round_trips_two_groups(cls):
    def build(model):
        return cls(
            model,
            lr=0.01,
            clip_grad_norm=MAX_NORM,
            weight_decay=0.2,
            param_groups=two_groups(model, lr=0.02),
        )

    straight, resumed = tiny_llama(), tiny_llama()
    opt = build(straight)
    for step in range(STEPS):
        opt.fused_backward(straight(**batch(step)).loss)
        if step == 1:
            saved_model = {k: v.clone() for k, v in straight.state_dict().items()}
            saved = copy.deepcopy(opt.state_dict())  # the moments change in place
    assert [g["lr"] for g in saved["param_groups"]] == [0.02, 0.01]
    resumed.load_state_dict(saved_model)
    again = build(resumed)
    again.param_groups[0]["lr"] = 1.0  # overwritten by the checkpoint
    again.load_state_dict(saved)
    assert [g["lr"] for g in again.param_groups] == [0.02, 0.01]
    for step in range(2, STEPS):
        again.fused_backward(resumed(**batch(step)).loss)
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="2 param groups, this optimizer 1"):
        cls(tiny_llama(), lr=0.01, clip_grad_norm=MAX_NORM).load_state_dict(saved)


def frozen_norm_model():
    model = tiny_llama()
    model.model.norm.weight.requires_grad_(False)
    return model


BAD_GROUPS = {
    "two groups": (
        lambda m: [{"params": ["lm_head.weight"]}, {"params": ["lm_head.weight"]}],
        ValueError,
        r"param_groups\[1\] lists 'lm_head.weight', already in param_groups\[0\]",
    ),
    "frozen": (
        lambda m: [{"params": ["model.norm.weight"]}],
        ValueError,
        "not a trainable parameter",
    ),
    "foreign": (
        lambda m: [{"params": [torch.nn.Parameter(torch.ones(3))]}],
        ValueError,
        "a tensor of shape \\(3,\\), which is not a trainable parameter",
    ),
    "unknown name": (lambda m: [{"params": ["model.nope"]}], ValueError, "no parameter name"),
    "unknown key": (
        lambda m: [{"params": ["lm_head.weight"], "momentum": 0.9}],
        ValueError,
        r"sets \['momentum'\], which this optimizer does not have",
    ),
    "bad value": (
        lambda m: [{"params": ["lm_head.weight"], "weight_decay": -1.0}],
        ValueError,
        r"param_groups\[0\]: weight_decay must be >= 0",
    ),
    "two thresholds": (
        lambda m: [{"params": ["lm_head.weight"], "clip_grad_norm": 2.0}],
        ValueError,
        "different clip_grad_norm",
    ),
    "not a list": (lambda m: {"params": ["lm_head.weight"]}, TypeError, "list of dicts"),
    "params a string": (
        lambda m: [{"params": "lm_head.weight"}],
        TypeError,
        "list of parameters or parameter names",
    ),
}


@pytest.mark.parametrize("case", BAD_GROUPS)
@pytest.mark.parametrize("cls", [Lomo, AdaLomo], ids=["Lomo", "AdaLomo"])
def test_bad_groups_refused_before_any_hook(cls, case):
    make, error, match = BAD_GROUPS[case]
    model = frozen_norm_model()
    with pytest.raises(error, match=match):
        cls(model, lr=0.01, clip_grad_norm=1.0, param_groups=make(model))
    assert not any(updated_in_backward(p) for p in model.parameters())


def test_tied_names_in_one_group_count_once_and_unlisted_get_defaults():
    model = tiny_llama(tie_word_embeddings=True)
    opt = Lomo(
        model,
        lr=0.01,
        weight_decay=0.1,
        param_groups=[{"params": ["lm_head.weight", "model.embed_tokens.weight"], "lr": 0.5}],
    )
    first, rest = opt.param_groups
    assert first["params"] == [model.lm_head.weight] and first["lr"] == 0.5
    assert first["weight_decay"] == 0.1  # not set by the group: the constructor's
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(rest["params"]) == len(trainable) - 1 and rest["lr"] == 0.01


def test_per_step_checks_hold_for_every_group():
    model = tiny_llama()
    opt = Lomo(model, lr=0.01, clip_grad_norm=1.0, param_groups=two_groups(model))
    before = [p.clone() for p in model.parameters()]
    opt.param_groups[1]["weight_decay"] = -0.5
    with pytest.raises(ValueError, match=r"param_groups\[1\]: weight_decay must be >= 0"):
        opt.fused_backward(model(**batch(0)).loss)
    opt.param_groups[1]["weight_decay"] = 0.0
    opt.param_groups[1]["clip_grad_norm"] = 2.0
    with pytest.raises(ValueError, match="different clip_grad_norm"):
        opt.fused_backward(model(**batch(0)).loss)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))
    opt.clip_grad_norm = 2.0  # sets every group
    opt.fused_backward(model(**batch(0)).loss)
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))


def test_an_lr_given_to_fused_backward_wins_for_its_step():
    """docs/usage.md (the learning rate): `fused_backward(loss, lr)` steps with `lr` and
    writes it into every group; a scheduler's next step() writes its own value: LambdaLR
    from its base lr, ExponentialLR (chainable) from the group's current lr, i.e. the one
    given."""
    a, b = tiny_llama(), tiny_llama()
    given = Lomo(a, lr=0.05)
    reference = Lomo(b, lr=0.2)
    given.fused_backward(a(**batch(0)).loss, 0.2)
    reference.fused_backward(b(**batch(0)).loss)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert [g["lr"] for g in given.param_groups] == [0.2]
    lambda_lr = torch.optim.lr_scheduler.LambdaLR(given, lambda step: 1.0)
    given.fused_backward(a(**batch(1)).loss, 0.3)
    lambda_lr.step()
    assert given.param_groups[0]["lr"] == 0.2  # LambdaLR: base lr (0.2 when it was built) x 1
    exponential = torch.optim.lr_scheduler.ExponentialLR(given, gamma=0.5)
    given.fused_backward(a(**batch(2)).loss, 0.4)
    exponential.step()
    assert given.param_groups[0]["lr"] == 0.2  # 0.4 (the given lr) x 0.5


def test_an_attribute_set_sets_every_group():
    """lomo-optim's attributes (opt.lr, opt.weight_decay, ...) read the first group; an
    assignment is checked, then sets every group."""
    model = tiny_llama()
    opt = Lomo(model, lr=0.05, param_groups=[{"params": ["model.norm.weight"], "lr": 0.5}])
    opt.lr, opt.weight_decay = 0.1, 0.02
    assert [(g["lr"], g["weight_decay"]) for g in opt.param_groups] == [(0.1, 0.02)] * 2
    with pytest.raises(ValueError, match="weight_decay must be >= 0"):
        opt.weight_decay = -1.0
    assert [g["weight_decay"] for g in opt.param_groups] == [0.02, 0.02]
