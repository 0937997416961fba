"""Lomo's fault handling: overflow steps change nothing, no host syncs, clear errors."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from support.faults import poison
from support.float64 import assert_within_ulp, lomo_update_f64
from support.host_sync import train_without_host_sync
from support.models import batch, clone, tiny_llama
from support.optimizers import OPTIMIZERS
from support.state import assert_refused, snapshot, unchanged

from lomo_kernels import Lomo


def expected_fp16_step(model, step, scale, lr, clip):
    """Float64 parameters after an applied step (`support.float64.lomo_update_f64`), from
    the gradients the optimizer's backward takes: those of ``loss * scale`` in fp16."""
    copy = clone(model)
    (copy(**batch(step)).loss * torch.tensor(scale)).backward()
    grads = [p.grad for p in copy.parameters()]
    coef = None
    if clip is not None:
        norm = math.sqrt(sum((g.double() / scale).square().sum().item() for g in grads))
        coef = min(1.0, clip / (norm + 1e-6))
    return [
        lomo_update_f64(p.detach(), g, lr=lr, inv_scale=1 / scale, clip_coef=coef)[0]
        for p, g in zip(copy.parameters(), grads, strict=True)
    ]


@pytest.mark.parametrize("bad_step", [0, 3], ids=["first_step", "step3"])
@pytest.mark.parametrize("clip", [None, 1.0], ids=["no_clip", "clip_norm"])
def test_fp16_overflow_step_changes_nothing_and_halves_scale(bad_step, clip):
    model = tiny_llama(torch.float16)
    opt = Lomo(model, lr=0.05, clip_grad_norm=clip, loss_scale_args={"init_scale": 2.0**12})
    counter = {"step": 0}
    poison(model.model.layers[1].mlp.down_proj.weight, {bad_step}, counter)
    for step in range(6):
        counter["step"] = step
        before, scale_before = snapshot(model), opt.loss_scaler.scale.item()
        if step != bad_step:
            expected = expected_fp16_step(model, step, scale_before, 0.05, clip)
        opt.fused_backward(model(**batch(step)).loss)
        if step == bad_step:
            assert unchanged(model, before)
            assert opt.loss_scaler.scale.item() == scale_before / 2
        else:
            # Divided by the scale of this step (the lowered one after an overflow). Bound:
            # the kernel's fp32 arithmetic rounded once to fp16 (<= 1/2 ulp) plus the fp32
            # norm's and coefficient's few-ulp-of-fp32 errors: within 1 fp16 ulp.
            assert not unchanged(model, before)
            for p, ref in zip(model.parameters(), expected, strict=True):
                assert_within_ulp(p.detach(), ref, torch.float16, ulps=1.0)
    opt.flush_report()
    assert not opt.last_step_skipped


def fp16_step_with_an_inf_gradient() -> Lomo:
    """One fp16 Lomo step whose embedding gradient holds an inf (its loss scaler's business)."""
    model = tiny_llama(torch.float16)
    opt = Lomo(model, lr=0.05)
    counter = {"step": 0}
    poison(model.model.embed_tokens.weight, {0}, counter)
    opt.fused_backward(model(**batch(0)).loss)
    return opt


def test_fp16_overflow_reported_as_skipped():
    opt = fp16_step_with_an_inf_gradient()
    opt.flush_report()
    assert opt.last_step_skipped


def test_fp16_overflow_at_min_scale_raises():
    model = tiny_llama(torch.float16)
    opt = Lomo(model, lr=0.05, loss_scale_args={"init_scale": 1.0, "min_scale": 1.0})
    counter = {"step": 0}
    poison(model.lm_head.weight, {0}, counter)
    opt.fused_backward(model(**batch(0)).loss)
    with pytest.raises(FloatingPointError, match="minimum"):
        opt.fused_backward(model(**batch(1)).loss)


def test_fp16_overflow_at_min_scale_without_raising_skips_the_step_and_trains_on():
    """raise_error_at_min_scale=False: the overflow at the minimum scale is a skipped step
    like any other, reported at the next call, which trains; the scale stays at the minimum."""
    model = tiny_llama(torch.float16)
    opt = Lomo(model, lr=0.05, loss_scale_args={"init_scale": 1.0, "min_scale": 1.0,
                                                "raise_error_at_min_scale": False})  # fmt: skip
    counter = {"step": 0}
    poison(model.lm_head.weight, {0}, counter)
    before = snapshot(model)
    opt.fused_backward(model(**batch(0)).loss)
    assert unchanged(model, before)
    counter["step"] = 1
    opt.fused_backward(model(**batch(1)).loss)
    assert opt.last_step_skipped and opt.loss_scaler.loss_scale == 1.0
    assert not unchanged(model, before)


def test_bf16_overflow_with_clip_norm_changes_nothing():
    model = tiny_llama(torch.bfloat16)
    opt = Lomo(model, lr=0.05, clip_grad_norm=1.0)
    counter = {"step": 0}
    poison(model.model.layers[0].self_attn.o_proj.weight, {0}, counter)
    before = snapshot(model)
    opt.fused_backward(model(**batch(0)).loss)
    assert unchanged(model, before)


def test_bf16_overflow_without_check_is_contained_and_reported():
    """An inf in one gradient element, no norm pass: that element keeps its value, every
    other element of every parameter takes the step a clean run takes (bit for bit: same
    gradients elsewhere, same rounding bits), and the step reports the overflow; the next,
    clean step reports none (the update pass's flag is the step's own)."""
    model, clean = tiny_llama(torch.bfloat16), tiny_llama(torch.bfloat16)
    target = model.model.layers[0].self_attn.o_proj.weight
    counter = {"step": 0}
    poison(target, {0}, counter)
    before = target.detach().clone()
    opt, clean_opt = Lomo(model, lr=0.05), Lomo(clean, lr=0.05)
    for trained, trainer in ((model, opt), (clean, clean_opt)):
        trainer.fused_backward(trained(**batch(0)).loss)
    middle = target.numel() // 2
    assert target.view(-1)[middle] == before.view(-1)[middle]
    clean_target = clean.model.layers[0].self_attn.o_proj.weight
    assert clean_target.view(-1)[middle] != before.view(-1)[middle]  # the step moves it
    others = torch.arange(target.numel()) != middle
    assert torch.equal(target.view(-1)[others], clean_target.view(-1)[others])
    for (name, p), q in zip(model.named_parameters(), clean.parameters(), strict=True):
        if p is not target:
            assert torch.equal(p, q), name
    with pytest.warns(RuntimeWarning, match="inf/nan gradient elements"):
        opt.flush_report()
    assert opt.last_step_partial
    counter["step"] = 1
    opt.fused_backward(model(**batch(1)).loss)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.flush_report()
    assert not opt.last_step_partial and not opt.last_step_skipped


@pytest.mark.parametrize(
    "dtype,clip,sr",
    [
        (torch.float16, None, False),
        (torch.bfloat16, 1.0, False),
        (torch.float32, None, False),
        (torch.bfloat16, None, True),
    ],
    ids=["fp16", "bf16_clip", "fp32", "bf16_stochastic_rounding"],
)
def test_no_host_sync_in_fused_backward(dtype, clip, sr):
    train_without_host_sync(Lomo, dtype, lr=0.05, clip_grad_norm=clip, stochastic_rounding=sr)


BAD_MODELS = {
    "no trainable": (
        lambda m: [p.requires_grad_(False) for p in m.parameters()],
        {},
        ValueError,
        "no trainable parameters",
    ),
    "float64": (lambda m: m.double(), {}, TypeError, "float64"),
    "clip_grad_norm 0": (lambda m: None, {"clip_grad_norm": 0.0}, ValueError, "positive"),
    "clip_grad_norm negative": (lambda m: None, {"clip_grad_norm": -1.0}, ValueError, "positive"),
    "negative lr": (lambda m: None, {"lr": -0.1}, ValueError, "lr must be"),
    "nan lr": (lambda m: None, {"lr": float("nan")}, ValueError, "lr must be"),
    "bad loss_scale_args": (
        lambda m: m.half(),
        {"loss_scale_args": {"init": 1}},
        ValueError,
        "unknown loss_scale_args",
    ),
}


@pytest.mark.parametrize("case", BAD_MODELS.keys())
def test_bad_configuration_raises_before_any_change(case):
    prepare, kwargs, error, message = BAD_MODELS[case]
    model = tiny_llama()
    prepare(model)
    before = snapshot(model)
    with pytest.raises(error, match=message):
        Lomo(model, **kwargs)
    assert unchanged(model, before)
    # No hook was left behind: a plain backward still works.
    if any(p.requires_grad for p in model.parameters()):
        model(**batch(0)).loss.backward()


def test_sparse_embedding_refused():
    """By the module's name, and by "the module" where the embedding is the model itself."""
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 1))
    with pytest.raises(ValueError, match="module '0' produces sparse.*set 0.sparse = False"):
        Lomo(model)
    with pytest.raises(ValueError, match="set the module.sparse = False"):
        Lomo(torch.nn.Embedding(10, 4, sparse=True))


def test_a_frozen_sparse_embedding_is_no_concern():
    """Only a trained embedding's gradient would be sparse: a frozen one gives none."""
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 1))
    model[0].requires_grad_(False)
    opt = Lomo(model, lr=0.1)
    before = model[1].weight.detach().clone()
    opt.fused_backward(model(torch.tensor([1, 2, 3])).sum())
    assert not torch.equal(model[1].weight, before)


def test_meta_device_refused():
    with torch.device("meta"):
        model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="meta"):
        Lomo(model)


@pytest.mark.parametrize("layout", ["transposed view", "sparse"])
def test_a_parameter_that_is_not_contiguous_and_dense_is_refused_at_construction(layout):
    """The kernels walk a parameter's memory flat: a transposed view (its elements out of
    order) or a sparse tensor is refused by name, with the way out."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    weight = model[1].weight.detach()
    model[1].weight = torch.nn.Parameter(
        weight.t().contiguous().t() if layout == "transposed view" else weight.to_sparse()
    )
    with pytest.raises(ValueError, match="'1.weight' is not a contiguous dense tensor"):
        Lomo(model)
    model[0](torch.ones(1, 4)).sum().backward()  # no hook attached: a plain backward runs
    assert model[0].weight.grad is not None


@pytest.mark.parametrize(
    ("loss_of", "match"),
    [
        (lambda out: out, "the loss must be a scalar tensor"),  # one value per row
        (lambda out: float(out.sum().detach()), "the loss must be a scalar tensor"),
        (lambda out: out.sum().detach(), "does not require grad"),
    ],
    ids=["per-row", "float", "detached"],
)
def test_a_loss_that_cannot_step_is_refused_before_any_change(loss_of, match):
    model = tiny_llama()
    opt = Lomo(model, lr=0.1)
    out = model(**batch(0)).logits[:, 0, 0]
    assert_refused(model, opt, lambda: opt.fused_backward(loss_of(out)), ValueError, match)


@pytest.mark.parametrize("lr", [-1.0, float("inf")])
def test_bad_lr_at_step_raises_before_any_change(lr):
    """Nothing changes: the parameters, and the groups' lr (in state_dict) and the device
    scalars the call would have set it in."""
    model = tiny_llama()
    opt = Lomo(model, lr=0.1)
    loss = model(**batch(0)).loss
    assert_refused(model, opt, lambda: opt.fused_backward(loss, lr), ValueError, "lr must be")
    assert [group["lr"] for group in opt.param_groups] == [0.1]


@pytest.mark.parametrize("given", ["a string", 3, {"lr": 1.0}], ids=["str", "int", "dict"])
def test_not_a_model_nor_parameters_refused(given):
    with pytest.raises(TypeError, match="a model \\(nn.Module\\), an iterable of parameters"):
        Lomo(given)


def test_clip_grad_value_zero_means_off_as_in_lomo_optim():
    a, b = tiny_llama(), tiny_llama()
    for model, value in ((a, 0.0), (b, None)):
        opt = Lomo(model, lr=0.1, clip_grad_value=value)
        opt.fused_backward(model(**batch(0)).loss)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_unknown_backend_name_refused_at_construction():
    model = tiny_llama()
    with pytest.raises(ValueError, match="unknown lomo_kernels backend"):
        Lomo(model, backend="cuda")
    model(**batch(0)).loss.backward()  # no hook left behind


@pytest.mark.parametrize(
    "name,dtype,options",
    [
        ("lomo", torch.bfloat16, {"clip_grad_norm": 1.0}),
        ("lomo", torch.float32, {"clip_grad_norm": 1.0}),
        ("adalomo", torch.bfloat16, {"clip_grad_norm": 1.0}),
        ("adalomo", torch.float16, {}),
    ],
    ids=["lomo-bf16-clip", "lomo-fp32-clip", "adalomo-bf16-clip", "adalomo-fp16"],
)
def test_a_step_skipped_whole_is_reported(name, dtype, options):
    """A non-finite global norm found by the norm pass (clipping, or AdaLomo's fp16 check,
    whose loss scale is static) skips the step whole: reported at the next call with a
    RuntimeWarning, as a partial step is, and in last_step_skipped. Lomo's fp16 steps, whose
    dynamic loss scale skips steps as its way of backing off, are not warned about."""
    model = tiny_llama(dtype)
    opt = OPTIMIZERS[name](model, lr=0.05, **options)
    counter = {"step": 0}
    poison(model.model.layers[0].mlp.up_proj.weight, {0}, counter)
    before = snapshot(model)
    opt.fused_backward(model(**batch(0)).loss)
    assert unchanged(model, before)
    with pytest.warns(RuntimeWarning, match="step 0: .*skipped whole"):
        opt.flush_report()
    assert opt.last_step_skipped and not opt.last_step_partial


def test_lomo_fp16_skipped_steps_are_the_scalers_business():
    import warnings

    opt = fp16_step_with_an_inf_gradient()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.flush_report()
    assert opt.last_step_skipped
