"""A step is either correct or refused before any parameter or state tensor changes."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from support.models import loss_of, mlp, tiny_llama
from support.optimizers import OPTIMIZERS
from support.state import (
    assert_refused,
    assert_same_state,
    assert_unchanged_since,
    optimizer_snapshot,
    same_bits,
    tensors,
)

from lomo_kernels import AdaLomo, Lomo

MODELS = {"llama": tiny_llama, "mlp": mlp}


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
def test_norm_pass_for_the_same_loss_is_used_once(name):
    """grad_norm(loss) then fused_backward(loss): two backward passes through the loss (the
    measured norm serves the update pass), the same step as fused_backward(loss) alone, which
    measures its own."""

    def run(measure_first: bool) -> tuple[int, list[torch.Tensor]]:
        model = mlp()
        opt = OPTIMIZERS[name](model, lr=0.05, clip_grad_norm=0.05)
        loss, passes = loss_of(model, 0), []
        loss.register_hook(lambda grad: passes.append(1))
        if measure_first:
            opt.grad_norm(loss)
        opt.fused_backward(loss)
        return len(passes), tensors(model, opt)

    (measured_passes, measured), (own_passes, own) = run(True), run(False)
    assert measured_passes == own_passes == 2
    assert same_bits(measured, own)


# ------------------------------------------------------------------ hyper-parameters

NAN = float("nan")

# (group key, edited value, error, message) refused at the next step, on both optimizers
BAD_GROUP_EDITS = {
    "lr nan": ("lr", NAN, ValueError, "lr must be finite"),
    "lr negative": ("lr", -0.1, ValueError, "lr must be"),
    "lr tensor": ("lr", torch.tensor(0.1), TypeError, "lr must be a Python number"),
    "weight_decay nan": ("weight_decay", NAN, ValueError, "weight_decay must be finite"),
    "weight_decay negative": ("weight_decay", -0.1, ValueError, "weight_decay must be >= 0"),
    "weight_decay None": ("weight_decay", None, TypeError, "weight_decay must be a number"),
    "clip_grad_value nan": ("clip_grad_value", NAN, ValueError, "clip_grad_value must be"),
    "clip_grad_norm 0": ("clip_grad_norm", 0.0, ValueError, "clip_grad_norm should be positive"),
    "clip_grad_norm nan": ("clip_grad_norm", NAN, ValueError, "clip_grad_norm must be finite"),
}

ADALOMO_BAD_GROUP_EDITS = {
    "eps nan": ("eps", (NAN, 1e-3), ValueError, "eps must be finite"),
    "eps one value": ("eps", 1e-3, ValueError, "eps must be two"),
    "eps0 zero": ("eps", (0.0, 1e-3), ValueError, r"eps\[0\] must be >="),
    "eps0 subnormal": ("eps", (1e-40, 1e-3), ValueError, r"eps\[0\] must be >="),
    "clip_threshold 0": ("clip_threshold", 0.0, ValueError, "clip_threshold must be > 0"),
    "decay_rate positive": ("decay_rate", 0.5, ValueError, "decay_rate must be < 0"),
}


def bad_edits():
    for case, edit in BAD_GROUP_EDITS.items():
        for name in OPTIMIZERS:
            yield pytest.param(name, *edit, id=f"{name}-{case}")
    for case, edit in ADALOMO_BAD_GROUP_EDITS.items():
        yield pytest.param("adalomo", *edit, id=f"adalomo-{case}")


@pytest.mark.parametrize("name,key,value,error,match", list(bad_edits()))
@pytest.mark.parametrize("call", ["fused_backward", "grad_norm"])
def test_bad_param_group_edit_refused_before_any_change(name, key, value, error, match, call):
    model = mlp()
    opt = OPTIMIZERS[name](model, lr=0.05, clip_grad_norm=1.0)
    opt.fused_backward(loss_of(model, 0))  # moments and loss scale not at their start
    opt.param_groups[0][key] = value
    loss = loss_of(model, 1)
    assert_refused(model, opt, lambda: getattr(opt, call)(loss), error, f"param_groups.0.: {match}")


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_lr_zero_is_a_step_that_moves_no_weight(name):
    """lr 0, a warm-up schedule's first value (transformers' linear warm-up starts there),
    given to the constructor or by the call, is accepted: the step is counted (AdaLomo's
    moments advance, as torch's Adam's do) and no weight moves, decay included."""
    model = mlp()
    opt = OPTIMIZERS[name](model, lr=0.0, weight_decay=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    opt.fused_backward(loss_of(model, 0))
    opt.param_groups[0]["lr"] = 0.5
    opt.fused_backward(loss_of(model, 1), lr=0.0)
    assert opt.step_count == 2 and opt.param_groups[0]["lr"] == 0.0
    assert same_bits(before, list(model.parameters()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_adalomo_at_the_eps0_floor_keeps_zero_rows_and_columns(backend, dtype):
    """eps[0] at its floor (float32's smallest normal number; 0 is refused): an embedding's
    rows no token used, and a weight's row and column of zero gradients, keep their values
    exactly (update 0, no 0/0), and every weight stays finite, on every backend."""
    from lomo_kernels.optim._hyper import EPS0_FLOOR

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 4)).to(dtype)
    embedding, linear = model[0].weight, model[1].weight
    unused_rows = embedding[[0, *range(3, 10)]].detach().clone()
    row, column = linear[0].detach().clone(), linear[:, 0].detach().clone()
    rest = linear[1:, 1:].detach().clone()
    opt = AdaLomo(model, lr=0.01, eps=(EPS0_FLOOR, 0.0), backend=backend)
    for _ in range(2):
        hidden = model[0](torch.tensor([[1, 2]])) * torch.tensor([0.0] + [1.0] * 7).to(dtype)
        opt.fused_backward(model[1](hidden)[..., 1:].float().pow(2).sum())
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert torch.equal(embedding[[0, *range(3, 10)]], unused_rows)
    assert torch.equal(linear[0], row) and torch.equal(linear[:, 0], column)
    assert (linear[1:, 1:] != rest).any()  # the other weights trained


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_numpy_scalars_are_numbers(name):
    # A schedule computed with numpy hands np.float32 (no float subclass) or np.int64: the
    # same step as the Python floats of the same values.
    import numpy as np

    def trained(lr, weight_decay):
        model = mlp()
        opt = OPTIMIZERS[name](model, lr=lr, weight_decay=weight_decay)
        opt.fused_backward(loss_of(model, 0), lr)
        return model

    ours = trained(np.float32(0.25), np.int64(0))
    ref = trained(float(np.float32(0.25)), 0.0)
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), ref.parameters(), strict=True))


def add_foreign_group(opt, model):
    opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(3))]})


def list_twice(opt, model):
    opt.param_groups[0]["params"].append(model[2].weight)


def remove_group(opt, model):
    opt.param_groups.pop()


def list_names(opt, model):
    opt.param_groups[0]["params"] = [name for name, _ in model.named_parameters()]


def delete_key(opt, model):
    del opt.param_groups[0]["weight_decay"]


GROUP_EDITS = {
    "group added": (add_foreign_group, r"param_groups\[1\] lists a tensor of shape \(3,\), which"),
    "listed twice": (list_twice, r"param_groups\[0\] lists '2.weight', already in"),
    "group removed": (remove_group, "'0.weight' is in no param group"),
    "names listed": (list_names, r"param_groups\[0\] lists str '0.weight', which"),
    "key deleted": (delete_key, r"param_groups\[0\] has no \['weight_decay'\]"),
}


@pytest.mark.parametrize("call", ["fused_backward", "grad_norm"])
@pytest.mark.parametrize("edit", GROUP_EDITS)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_param_group_structure_edit_refused_before_any_change(name, edit, call):
    """The hooks step the parameters the optimizer was built with, each with its group's
    values: a parameter added to the groups (no hook), listed twice or left out of every
    group, or a group without one of the values, is refused before any change (moving a
    parameter between groups is served: test_param_groups.py)."""
    model = mlp()
    opt = OPTIMIZERS[name](model, lr=0.1)
    opt.fused_backward(loss_of(model, 0))
    change, match = GROUP_EDITS[edit]
    loss = loss_of(model, 1)
    # Taken before the edit (an edited optimizer has no state_dict), compared once the
    # groups are restored.
    before = optimizer_snapshot(model, opt)
    kept = [(group, dict(group, params=list(group["params"]))) for group in opt.param_groups]
    change(opt, model)
    with pytest.raises(ValueError, match=match):
        getattr(opt, call)(loss)
    for group, values in kept:
        group.clear()
        group.update(values)
    opt.param_groups[:] = [group for group, _ in kept]
    assert_unchanged_since(before, model, opt)


@pytest.mark.parametrize("name,dtype", [("lomo", torch.float16), ("adalomo", torch.float32)])
def test_fused_backward_under_no_grad_is_the_same_step(name, dtype):
    """A loss scaled inside fused_backward (fp16 Lomo's dynamic scale, AdaLomo's static one)
    with the call under torch.no_grad(): the same steps, bit for bit, as outside it."""

    def run(no_grad: bool) -> list[torch.Tensor]:
        model = mlp().to(dtype)
        opt = OPTIMIZERS[name](model, lr=0.05)
        for step in range(2):
            loss = loss_of(model, step)
            with torch.no_grad() if no_grad else contextlib.nullcontext():
                opt.fused_backward(loss)
        return tensors(model, opt)

    assert same_bits(run(True), run(False))


def test_adalomo_loss_scale_edit_refused_before_any_change():
    model = mlp()
    opt = AdaLomo(model, lr=0.05)
    opt.loss_scale = 0.0
    loss = loss_of(model, 0)
    assert_refused(model, opt, lambda: opt.fused_backward(loss), ValueError, "loss_scale must")


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("value", [0.0, -1.0], ids=["zero", "negative"])
def test_clip_grad_value_zero_or_less_means_off_in_constructor_and_groups(name, value):
    """lomo-optim's meaning (<= 0: no clipping by value), the same set either way."""

    def run(constructed, edited):
        model = mlp()
        opt = OPTIMIZERS[name](model, lr=0.5, clip_grad_value=constructed)
        if edited is not None:
            opt.param_groups[0]["clip_grad_value"] = edited
        opt.fused_backward(loss_of(model, 0))
        return tensors(model, opt)

    off = run(None, None)
    assert same_bits(run(value, None), off)
    assert same_bits(run(1e-4, value), off)
    assert not same_bits(run(1e-4, None), off)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_clip_grad_norm_set_after_construction_acts_as_constructed(name):
    def run(constructed, edited):
        model = mlp()
        opt = OPTIMIZERS[name](model, lr=0.5, clip_grad_norm=constructed)
        if edited is not None:
            opt.clip_grad_norm = edited
        loss = loss_of(model, 0)
        if edited is not None:
            opt.grad_norm(loss)  # measured before the edit below: measured again
            opt.param_groups[0]["clip_grad_norm"] = 0.01
        opt.fused_backward(loss)
        return tensors(model, opt)

    assert same_bits(run(None, 5.0), run(0.01, None))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_negative_weight_decay_refused_at_construction(name):
    model = mlp()
    with pytest.raises(ValueError, match="weight_decay must be >= 0.*ignores a negative"):
        OPTIMIZERS[name](model, weight_decay=-0.01)


# ------------------------------------------------------------------ load_state_dict


def trained(name, model_name="mlp", dtype=torch.float32, **kwargs):
    model = MODELS[model_name]().to(dtype)
    opt = OPTIMIZERS[name](model, lr=0.05, **kwargs)
    for step in range(2):
        opt.fused_backward(loss_of(model, step))
    return model, opt


def edit_moment(value):
    def edit(state):
        moments = state["state"][0]
        key = sorted(moments)[0]
        moments[key] = moments[key].clone()
        moments[key].view(-1)[0] = value

    return edit


def edit_lomo(key, value):
    def edit(state):
        state["lomo"][key] = value

    return edit


def edit_group(key, value):
    def edit(state):
        state["param_groups"][0][key] = value

    return edit


def cast_moments(dtype, value=None):
    """The moments of parameter 0 given in `dtype` (a load keeps them in fp32), the first
    element set to `value`."""

    def edit(state):
        moments = state["state"][0]
        for key in moments:
            moments[key] = moments[key].to(dtype)
        if value is not None:
            key = sorted(moments)[0]
            moments[key].view(-1)[0] = value

    return edit


def drop_state(state):
    del state["state"][1]


def add_state(state):
    state["state"][99] = {"exp_avg_sq": torch.zeros(3)}


def add_moment(state):
    state["state"][0]["exp_avg"] = torch.zeros(3)  # another optimizer's moment


def drop_moment(state):
    moments = state["state"][0]
    del moments[sorted(moments)[0]]


def reshape_moment(state):
    moments = state["state"][0]
    key = sorted(moments)[0]
    moments[key] = torch.zeros(moments[key].numel() + 1)


# (optimizer, edit of its own state_dict, message)
BAD_STATES = {
    "adalomo nan moment": ("adalomo", edit_moment(float("nan")), "holds inf/nan"),
    "adalomo negative moment": ("adalomo", edit_moment(-1.0), "negative values"),
    "adalomo missing index": ("adalomo", drop_state, r"\[1\].*is missing"),
    "adalomo extra index": ("adalomo", add_state, r"indices \[99\]"),
    "adalomo moment shape": ("adalomo", reshape_moment, "has shape"),
    "adalomo extra moment": ("adalomo", add_moment, r"has the keys \['exp_avg', "),
    "adalomo missing moment": ("adalomo", drop_moment, r"has the keys \['exp_avg_sq_row'\]"),
    # Finite in float64, inf once kept in fp32.
    "adalomo moment past fp32": ("adalomo", cast_moments(torch.float64, 1e300), "holds inf/nan"),
    "adalomo integer moments": ("adalomo", cast_moments(torch.int64), "not a floating-point"),
    "adalomo complex moments": ("adalomo", cast_moments(torch.complex64), "not a floating-point"),
    "lomo extra index": ("lomo", add_state, "Lomo keeps none"),
    "step_count negative": ("lomo", edit_lomo("step_count", -1), "step_count"),
    # A corrupt checkpoint's value, refused as its others are (ValueError, which a sharded
    # load's ranks agree on), not as a caller's wrong type.
    "step_count not an int": ("lomo", edit_lomo("step_count", 2.5), r"step_count.*got 2\.5"),
    "group lr nan": ("lomo", edit_group("lr", float("nan")), "lr must be finite"),
    "group weight_decay negative": ("adalomo", edit_group("weight_decay", -1.0), ">= 0"),
    "group key missing": ("adalomo", lambda s: s["param_groups"][0].pop("eps"), "another"),
    "norm history nan": (
        "lomo",
        edit_lomo("single_backward", {"norm_history": [1.0, float("nan"), 1.0]}),
        "norm_history",
    ),
    "norm history negative": (
        "lomo",
        edit_lomo("single_backward", {"norm_history": [1.0, -0.5, 1.0]}),
        "norm_history",
    ),
    "norm history of two": (
        "lomo",
        edit_lomo("single_backward", {"norm_history": [1.0, 1.0]}),
        "norm_history",
    ),
    "norm history of strings": (
        "lomo",
        edit_lomo("single_backward", {"norm_history": ["1.0", "1.0", "1.0"]}),
        "norm_history",
    ),
}


@pytest.mark.parametrize("case", BAD_STATES)
def test_bad_state_dict_refused_with_nothing_applied(case):
    name, edit, match = BAD_STATES[case]
    model, opt = trained(name, single_backward=True, clip_grad_norm=1.0)
    state = opt.state_dict()
    edit(state)
    fresh_model = mlp()
    fresh = OPTIMIZERS[name](fresh_model, lr=0.3, single_backward=True, clip_grad_norm=1.0)
    groups_before = [dict(g) for g in fresh.param_groups]
    assert_refused(fresh_model, fresh, lambda: fresh.load_state_dict(state), ValueError, match)
    assert fresh.step_count == 0 and fresh.param_groups == groups_before


# A saved scaler's scale, counters and settings that would scale wrongly: a negative
# hysteresis never reaches 1, so with delayed_shift > 1 an overflow would never lower the
# scale again.
BAD_SCALER_ENTRIES = {
    "scale_nan": ("scale", float("nan"), "scale must be finite and > 0"),
    "scale_zero": ("scale", 0.0, "scale must be finite and > 0"),
    "scale_inf": ("scale", float("inf"), "scale must be finite and > 0"),
    "scale_negative": ("scale", -2.0, "scale must be finite and > 0"),
    "negative_hysteresis": ("hysteresis", -1, "negative hysteresis or iteration counter"),
    "negative_iteration": ("cur_iter", -3, "negative hysteresis or iteration counter"),
    "overflow_before_start": ("last_overflow_iter", -2, "negative hysteresis or iteration"),
    "factor_one": ("scale_factor", 1.0, "scale_factor must be > 1"),
    "window_zero": ("scale_window", 0, "scale_window and delayed_shift must be >= 1"),
    "shift_zero": ("delayed_shift", 0, "scale_window and delayed_shift must be >= 1"),
    "min_scale_zero": ("min_scale", 0.0, "min_scale must be finite and > 0"),
    "not_a_number": ("cur_iter", "ten", "a value is not a number"),
    "missing": ("hysteresis", None, "must be a dict with the keys"),
}


@pytest.mark.parametrize("case", BAD_SCALER_ENTRIES.keys())
def test_bad_loss_scaler_entry_in_state_dict_refused(case):
    key, value, match = BAD_SCALER_ENTRIES[case]
    _, opt = trained("lomo", dtype=torch.float16)
    state = opt.state_dict()
    scaler = state["lomo"]["loss_scaler"]
    if value is None:
        del scaler[key]
    else:
        scaler[key] = value
    fresh_model = mlp().half()
    fresh = Lomo(fresh_model)
    assert_refused(fresh_model, fresh, lambda: fresh.load_state_dict(state), ValueError, match)


@pytest.mark.parametrize("writer,reader", [("lomo", "adalomo"), ("adalomo", "lomo")])
@pytest.mark.parametrize("marked", [True, False], ids=["marked", "older_checkpoint"])
def test_state_dict_of_the_other_optimizer_refused(writer, reader, marked):
    _, opt = trained(writer)
    state = opt.state_dict()
    if not marked:
        del state["lomo"]["optimizer"]
    fresh_model = mlp()
    fresh = OPTIMIZERS[reader](fresh_model)
    match = "written by" if marked else "another optimizer class"
    assert_refused(fresh_model, fresh, lambda: fresh.load_state_dict(state), ValueError, match)


def test_state_dict_of_another_model_refused():
    _, opt = trained("adalomo", model_name="llama")
    fresh_model = mlp()
    fresh = AdaLomo(fresh_model)
    assert_refused(
        fresh_model,
        fresh,
        lambda: fresh.load_state_dict(opt.state_dict()),
        ValueError,
        "parameters, this optimizer's",
    )


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_valid_state_dict_round_trip_still_loads(name):
    model, opt = trained(name, single_backward=True, clip_grad_norm=1.0)
    fresh = OPTIMIZERS[name](mlp(), single_backward=True, clip_grad_norm=1.0)
    fresh.load_state_dict(opt.state_dict())
    assert fresh.step_count == 2
    for p, q in zip(
        [p for g in opt.param_groups for p in g["params"]],
        [p for g in fresh.param_groups for p in g["params"]],
        strict=True,
    ):
        assert opt.state[p].keys() == fresh.state[q].keys()
        assert all(torch.equal(opt.state[p][k], fresh.state[q][k]) for k in opt.state[p])


@pytest.mark.parametrize("writer,reader", [("adalomo", "lomo"), ("lomo", "adalomo")])
def test_state_dict_of_the_other_class_refused_naming_it(writer, reader):
    _, written = trained(writer)
    model = mlp()
    opt = OPTIMIZERS[reader](model, lr=0.05)
    load = lambda: opt.load_state_dict(written.state_dict())  # noqa: E731
    match = f"written by {type(written).__name__}; {type(opt).__name__} keeps other state"
    assert_refused(model, opt, load, ValueError, match)


def test_state_dict_and_load_state_dict_copy_the_moments():
    """AdaLomo's moments are updated in place each step: a state_dict holds copies (the
    optimizer's later steps leave it as it was), and a load takes copies (two optimizers
    loaded from one state_dict do not share moments, and neither changes the dict)."""
    _, opt = trained("adalomo")
    saved = opt.state_dict()
    kept = copy.deepcopy(saved)
    opt.fused_backward(loss_of(opt.model, 2))
    assert_same_state(saved, kept)
    pairs = [(model, AdaLomo(model, lr=0.05)) for model in (mlp(), mlp())]
    for _, other in pairs:
        other.load_state_dict(saved)
    results = []
    for model, other in pairs:  # the first's step must not move the second's moments
        other.fused_backward(loss_of(model, 2))
        results.append(tensors(model, other))
    assert same_bits(*results)
    assert_same_state(saved, kept)


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
def test_adalomo_empty_last_dimension_is_a_clear_error_and_leaves_no_hook():
    model = torch.nn.Linear(0, 4)
    with pytest.raises(ValueError, match=r"shape \(4, 0\).*empty"):
        AdaLomo(model)
    model(torch.zeros(2, 0)).sum().backward()
    assert model.bias.grad is not None
