"""AdaLomo against lomo_optim.AdaLomo, and its state handling."""

from __future__ import annotations

import copy

import pytest
import torch
from support import lomo_optim_runs
from support.faults import poison
from support.host_sync import train_without_host_sync
from support.lomo_optim_runs import CONFIGS, STEPS, assert_bf16_parity, train
from support.models import batch, max_rel_diff, tiny_llama
from support.state import snapshot, unchanged

from lomo_kernels import AdaLomo

LR = 0.01


@pytest.fixture
def cuda_is_identity(monkeypatch):
    """lomo_optim.AdaLomo allocates its state with a hard-coded .cuda(): keep it on CPU."""
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)


def train_ours(model, steps=STEPS, call_grad_norm=False, **kwargs):
    return train(AdaLomo, model, LR, steps, call_grad_norm, **kwargs)


def train_official(model, steps=STEPS, **kwargs):
    return lomo_optim_runs.train_official("AdaLomo", model, LR, steps, **kwargs)


@pytest.mark.parametrize("config", CONFIGS.keys())
def test_fp32_parity_with_lomo_optim(cuda_is_identity, backend, config):
    kwargs = CONFIGS[config]
    ours, official = tiny_llama(), tiny_llama()
    train_ours(ours, call_grad_norm="clip_grad_norm" in kwargs, backend=backend, **kwargs)
    train_official(official, **kwargs)
    # Reductions (row/column means, RMS) are summed in a different order than torch's.
    assert max_rel_diff(ours, official) <= 1e-5


@pytest.mark.parametrize("config", ["plain", "all"])
def test_bf16_parity_with_lomo_optim(cuda_is_identity, config):
    """lomo-optim's rounding (stochastic_rounding=False; ours rounds stochastically by
    default): within the bound `assert_bf16_parity` derives."""
    kwargs = CONFIGS[config]
    exact = tiny_llama()
    ours, official = tiny_llama(torch.bfloat16), tiny_llama(torch.bfloat16)
    train_ours(ours, stochastic_rounding=False, call_grad_norm="clip_grad_norm" in kwargs, **kwargs)
    train_official(official, **kwargs)
    train_official(exact, **kwargs)
    assert_bf16_parity(ours, official, exact, tiny_llama())


def test_state_only_for_trainable_parameters_on_their_device():
    model = tiny_llama()
    frozen = model.model.layers[0].mlp.up_proj.weight
    frozen.requires_grad_(False)
    opt = AdaLomo(model)
    assert frozen not in opt.state
    weight = model.model.layers[1].mlp.up_proj.weight
    norm = model.model.norm.weight
    assert opt.state[weight]["exp_avg_sq_row"].shape == (weight.shape[0],)
    assert opt.state[weight]["exp_avg_sq_col"].shape == (weight.shape[1],)
    assert opt.state[norm]["exp_avg_sq"].shape == norm.shape
    assert all(
        v.dtype == torch.float32 and v.device == weight.device
        for s in opt.state.values()
        for v in s.values()
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_state_dict_resume_is_exact(dtype):
    def run(model, opt, steps):
        for step in steps:
            opt.fused_backward(model(**batch(step)).loss, LR)

    straight = tiny_llama(dtype)
    run(straight, AdaLomo(straight, clip_grad_norm=1.0), range(8))

    first = tiny_llama(dtype)
    opt1 = AdaLomo(first, clip_grad_norm=1.0)
    run(first, opt1, range(4))
    saved_model = {k: v.clone() for k, v in first.state_dict().items()}
    saved_opt = opt1.state_dict()

    resumed = tiny_llama(dtype, seed=99)
    resumed.load_state_dict(saved_model)
    opt2 = AdaLomo(resumed, clip_grad_norm=1.0)
    opt2.load_state_dict(saved_opt)
    assert opt2.step_count == 4
    run(resumed, opt2, range(4, 8))
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_fp16_overflow_changes_nothing_including_moments():
    model = tiny_llama(torch.float16)
    opt = AdaLomo(model, lr=LR)
    counter = {"step": 0}
    poison(model.model.layers[1].self_attn.v_proj.weight, {2}, counter)
    for step in range(4):
        counter["step"] = step
        before = snapshot(model)
        moments = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
        opt.fused_backward(model(**batch(step)).loss)
        if step == 2:
            assert unchanged(model, before)
            assert all(
                torch.equal(v, moments[id(p)][k])
                for p, s in opt.state.items()
                for k, v in s.items()
            )
        else:
            assert not unchanged(model, before)


def test_loss_falls_bf16():
    model = tiny_llama(torch.bfloat16)
    opt = AdaLomo(model, lr=0.05)
    fixed = batch(0)
    first = model(**fixed).loss.item()
    for _ in range(10):
        opt.fused_backward(model(**fixed).loss)
    assert model(**fixed).loss.item() < first - 0.5


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"clip_grad_norm": 0.0}, "positive"),
        ({"lr": float("nan")}, "lr must be"),
        ({"decay_rate": 0.5}, "decay_rate"),
        ({"clip_threshold": 0.0}, "clip_threshold"),
        ({"loss_scale": 0.0}, "loss_scale"),
        ({"eps": (0.0, 1e-3)}, r"eps\[0\] must be >= 1.18e-38"),
    ],
)
def test_bad_arguments_raise_before_hooks(kwargs, message):
    model = tiny_llama()
    with pytest.raises(ValueError, match=message):
        AdaLomo(model, **kwargs)
    model(**batch(0)).loss.backward()  # no hook left behind


@pytest.mark.parametrize(
    "dtype,clip",
    [(torch.float16, None), (torch.bfloat16, 1.0), (torch.float32, None)],
    ids=["fp16", "bf16_clip", "fp32"],
)
def test_no_host_sync_in_fused_backward(dtype, clip):
    train_without_host_sync(AdaLomo, dtype, lr=LR, clip_grad_norm=clip)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_per_tensor_update_is_the_public_function_bit_for_bit(backend, dtype):
    """AdaLomo's eager per-tensor update (backend resolved, arguments checked once per step,
    one workspace per shape reused) against `ops.adalomo_update_` called on each gradient
    with the step's values: the same bits. Two same-shape matrices and two biases share
    workspaces; the weight decay and clip value reach every pass; low-precision weights
    round stochastically (the default) from the parameter's index and the step's seed."""
    from lomo_kernels.ops import adalomo_update_
    from lomo_kernels.optim.rounding import parameter_seed

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(7, 5), torch.nn.Linear(5, 5), torch.nn.Linear(5, 5, bias=False)
    ).to(dtype)
    reference = copy.deepcopy(model)
    options = {"weight_decay": 0.1, "clip_grad_value": 0.05}
    opt = AdaLomo(model, lr=LR, backend=backend, **options)
    states = {p: {} for p in reference.parameters()}
    inv_scale = 1.0 / opt.loss_scale
    for t in range(1, 4):
        x = torch.randn(4, 7, dtype=dtype)
        opt.fused_backward(model(x).square().mean(), LR)
        (reference(x).square().mean() / inv_scale).backward()
        with torch.no_grad():
            for index, p in enumerate(reference.parameters()):
                low = dtype != torch.float32
                adalomo_update_(
                    p, p.grad, states[p], lr=LR, beta2=1.0 - t**-0.8, inv_scale=inv_scale,
                    weight_decay=0.1, clip_value=0.05, backend=backend,
                    stochastic_rounding=low, seed=parameter_seed(index) if low else 0,
                    seed_step=opt.rounding.seed_step(p.device) if low else None,
                )  # fmt: skip
                p.grad = None
    pairs = list(zip(model.parameters(), reference.parameters(), strict=True))
    assert all(torch.equal(p, q) for p, q in pairs)
    for p, q in pairs:
        assert all(torch.equal(opt.state[p][k], v) for k, v in states[q].items())


BROKEN_EACH_STEP = {
    # A step-wide scalar the per-tensor calls pass, checked once per step.
    "beta2": (lambda opt, p: opt._beta2.update({(p.device, 0): torch.ones(2)}), "beta2"),
    # A moment replaced by one of another size: checked once per step too.
    "state": (
        lambda opt, p: opt.state[p].update(exp_avg_sq_row=torch.zeros(p.shape[0] + 1)),
        "exp_avg_sq_row",
    ),
}


@pytest.mark.parametrize("broken", BROKEN_EACH_STEP)
@pytest.mark.parametrize("clip_grad_norm", [None, 1.0])
def test_the_update_public_checks_run_once_per_step(broken, clip_grad_norm):
    """AdaLomo's per-tensor calls skip the public function's conversions and state checks;
    they run on the step's values once per step instead: a value not in the op's form is
    refused by name before any parameter changes (even of the parameters stepped before
    the broken one in backward)."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    opt = AdaLomo(model, lr=0.1, clip_grad_norm=clip_grad_norm)
    x = torch.randn(4, 6)
    opt.fused_backward(model(x).square().mean())  # a good step
    before = [p.detach().clone() for p in model.parameters()]
    states = {k: v.clone() for k, v in opt.state[model[1].weight].items()}
    breaks, name = BROKEN_EACH_STEP[broken]
    breaks(opt, model[0].weight)  # the first layer's weight: stepped last in backward
    with pytest.raises(ValueError, match=name):
        opt.fused_backward(model(x).square().mean())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(torch.equal(opt.state[model[1].weight][k], v) for k, v in states.items())
