"""Lomo against torch.optim.SGD and lomo_optim.Lomo, and its mechanics."""

from __future__ import annotations

import warnings

import pytest
import torch
from support import lomo_optim_runs
from support.faults import poison
from support.lomo_optim_runs import CONFIGS, STEPS, assert_bf16_parity, train
from support.models import batch, max_rel_diff, tiny_llama
from support.recording import record_lomo_calls

import lomo_kernels
from lomo_kernels import Lomo
from lomo_kernels.optim.rounding import parameter_seed


def train_ours(model, steps=STEPS, lr=0.05, call_grad_norm=False, **kwargs):
    return train(Lomo, model, lr, steps, call_grad_norm, **kwargs)


def train_sgd(
    model, steps=STEPS, lr=0.05, weight_decay=0.0, clip_grad_norm=None, clip_grad_value=None
):
    opt = torch.optim.SGD(model.parameters(), lr=lr, weight_decay=weight_decay)
    for step in range(steps):
        loss = model(**batch(step)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
        if clip_grad_value is not None:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip_grad_value)
        opt.step()


def train_official(model, steps=STEPS, lr=0.05, **kwargs):
    return lomo_optim_runs.train_official("Lomo", model, lr, steps, **kwargs)


@pytest.mark.parametrize("config", ["plain", "weight_decay", "clip_norm"])
def test_fp32_equals_torch_sgd(backend, config):
    kwargs = CONFIGS[config]
    ours, ref = tiny_llama(), tiny_llama()
    train_ours(ours, backend=backend, **kwargs)
    train_sgd(ref, **kwargs)
    assert max_rel_diff(ours, ref) <= 1e-6


def test_fp32_clip_above_the_norm_changes_nothing(backend):
    # clip_grad_norm above every step's norm (the tiny LLaMA's are about 2-3): the
    # coefficient min(1, 100 / norm) is 1, so the steps are plain SGD's (torch's clip does not
    # scale a gradient up either).
    ours, ref = tiny_llama(), tiny_llama()
    opt = train_ours(ours, backend=backend, clip_grad_norm=100.0)
    assert float(opt.last_grad_norm) < 100.0
    train_sgd(ref)
    assert max_rel_diff(ours, ref) <= 1e-6


def test_fp32_clip_value_equals_sgd_after_clip_grad_value(backend):
    ours, ref = tiny_llama(), tiny_llama()
    train_ours(ours, backend=backend, clip_grad_value=0.01)
    train_sgd(ref, clip_grad_value=0.01)
    assert max_rel_diff(ours, ref) <= 1e-6


@pytest.mark.parametrize("config", CONFIGS.keys())
def test_fp32_parity_with_lomo_optim(config):
    kwargs = CONFIGS[config]
    ours, official = tiny_llama(), tiny_llama()
    train_ours(ours, call_grad_norm="clip_grad_norm" in kwargs, **kwargs)
    train_official(official, **kwargs)
    assert max_rel_diff(ours, official) <= 1e-6


@pytest.mark.parametrize("config", CONFIGS.keys())
def test_bf16_parity_with_lomo_optim(config):
    """lomo-optim's rounding (stochastic_rounding=False; ours rounds stochastically by
    default): within the bound `assert_bf16_parity` derives (seen: bit for bit)."""
    kwargs = CONFIGS[config]
    exact = tiny_llama()
    ours, official = tiny_llama(torch.bfloat16), tiny_llama(torch.bfloat16)
    train_ours(ours, stochastic_rounding=False, call_grad_norm="clip_grad_norm" in kwargs, **kwargs)
    train_official(official, **kwargs)
    train_official(exact, **kwargs)
    assert_bf16_parity(ours, official, exact, tiny_llama())


def test_loss_falls_bf16_stochastic_rounding():
    model = tiny_llama(torch.bfloat16)
    opt = Lomo(model, lr=0.2, stochastic_rounding=True, seed=3)
    fixed = batch(0)
    first = model(**fixed).loss.item()
    for _ in range(15):
        opt.fused_backward(model(**fixed).loss)
    assert model(**fixed).loss.item() < first - 0.3


def _stochastic_run(seed: int, steps: int = 2) -> list[torch.Tensor]:
    model = tiny_llama(torch.bfloat16)
    opt = Lomo(model, lr=0.05, stochastic_rounding=True, seed=seed)
    for step in range(steps):
        opt.fused_backward(model(**batch(step)).loss)
    return [p.detach().clone() for p in model.parameters()]


def test_stochastic_rounding_reproducible_per_seed():
    """The rounding is a function of (seed, step, parameter): same seed, same weights."""
    first, again, other = _stochastic_run(3), _stochastic_run(3), _stochastic_run(4)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, other, strict=True))
    # Every bit of the 63-bit seed counts: seeds that differ only in their high half too.
    for high in (3 + 2**32, 3 + 2**62):
        run = _stochastic_run(high)
        assert not all(torch.equal(a, b) for a, b in zip(first, run, strict=True))


def test_two_parameters_draw_unrelated_bits_from_step_to_step():
    """At a step, element e of parameter i draws the bits of element e ^ d of parameter j,
    d the XOR of their rounding keys: d must change with the step, or the same pairs of
    elements would draw the same bits at every step (correlated rounding across tensors)."""
    from lomo_kernels.core.rounding import seed_key
    from lomo_kernels.optim.rounding import step_value

    for i, j in ((0, 1), (28, 72), (3, 1000)):
        d = {
            seed_key(parameter_seed(i), step_value(0, t))
            ^ seed_key(parameter_seed(j), step_value(0, t))
            for t in range(8)
        }
        assert len(d) == 8


def test_stochastic_rounding_seed_step_follows_step_count():
    """The per-step part of the seed lives in a device tensor, refreshed before each step's
    backward, also after a checkpoint moved step_count."""
    model = tiny_llama(torch.bfloat16)
    opt = Lomo(model, lr=0.05, stochastic_rounding=True, seed=3)
    values = []
    for step in range(3):
        opt.fused_backward(model(**batch(step)).loss)
        seed_step = opt.rounding.seed_step(torch.device("cpu"))
        values.append(int(seed_step))
    assert len(set(values)) == 3
    state = opt.state_dict()
    state["lomo"]["step_count"] = 1
    opt.load_state_dict(state)
    opt.fused_backward(model(**batch(0)).loss)
    assert int(seed_step) == values[1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("cuts", [(4096,), (1, 4097), (3, 1000, 5001, 6143)])
def test_stochastic_rounding_of_slices_equals_the_whole_tensor(dtype, cuts):
    """Sharded updates (ZeRO-3, FSDP2) step each rank's flat slice on its own: slices cut at
    any offsets round exactly as the whole tensor's update does, bit for bit."""
    from lomo_kernels.distributed import Shard
    from lomo_kernels.optim.piece import PieceBatch

    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(48, 128).to(dtype))  # 6144 elements
    grad = torch.randn(param.shape) * 1e-3  # mostly below half an ulp
    whole = param.detach().clone()
    opt = Lomo(torch.nn.Linear(1, 1).to(dtype), lr=1.0)  # its parameter index 0 is the seed
    opt._prepare_scalars()
    scalars = opt._scalars.for_device(param.device)
    shard_param = next(opt.model.parameters())

    # fp16 weights scale the loss: the gradient arrives scaled and the update unscales it.
    scale = 1.0 if opt.loss_scaler is None else float(opt.loss_scaler.scale)

    def step(local: torch.Tensor, offset: int) -> None:
        shard = Shard(shard_param, local, offset, param.shape, None)
        flat_grad = grad.reshape(-1)[offset : offset + local.numel()] * scale
        piece = opt._piece(shard.param, flat_grad, scalars, scalars.no_skip, shard)
        opt._update_shards(PieceBatch([piece], scalars, scalars.no_skip))

    step(whole.view(-1), 0)
    sliced = param.detach().clone().view(-1)
    bounds = [0, *cuts, sliced.numel()]
    for a, b in zip(bounds, bounds[1:], strict=False):
        step(sliced[a:b], a)
    assert torch.equal(sliced.view(torch.int16), whole.view(-1).view(torch.int16))
    moved = (whole != param.detach()).float().mean().item()
    assert 0.05 < moved < 0.95  # stochastic: some elements moved, not all


def test_default_rounding_is_stochastic_for_low_precision_only():
    """bf16 and fp16 parameters round stochastically by default; fp32 ones are bit for bit
    what stochastic_rounding=False gives (nothing to round)."""
    assert Lomo(tiny_llama(torch.bfloat16)).stochastic_rounding
    fp32 = {}
    for sr in (True, False):
        model = tiny_llama()
        train_ours(model, steps=2, stochastic_rounding=sr)
        fp32[sr] = [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(fp32[True], fp32[False], strict=True))


def test_lr_from_param_groups_follows_scheduler():
    ours, ref = tiny_llama(), tiny_llama()
    opt = Lomo(ours, lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    for step in range(6):
        opt.fused_backward(ours(**batch(step)).loss)
        opt.step()  # a documented no-op, as frameworks call it
        sched.step()
        ref_opt.zero_grad()
        ref(**batch(step)).loss.backward()
        ref_opt.step()
        ref_sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
    assert max_rel_diff(ours, ref) <= 1e-6


def test_a_scheduler_stepped_after_fused_backward_alone_does_not_warn():
    """lomo-optim's loop calls no opt.step(): the step happens in fused_backward, which tells
    torch's schedulers so, or their first step() would warn that it came before the
    optimizer's."""
    model = tiny_llama()
    opt = Lomo(model, lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(2):
            opt.fused_backward(model(**batch(step)).loss)
            sched.step()
    assert opt.param_groups[0]["lr"] == 0.1 * 0.5**2


@pytest.mark.parametrize("kind", ["one_cycle", "cyclic"])
def test_cyclic_schedulers_without_momentum_follow_sgd(kind):
    """docs/usage.md: OneCycleLR and CyclicLR take cycle_momentum=False (torch refuses their
    default for an optimizer without momentum, as for SGD without it); the lr and the weights
    then follow torch's SGD under the same scheduler."""

    def scheduler(opt, cycle_momentum=False):
        if kind == "one_cycle":
            return torch.optim.lr_scheduler.OneCycleLR(
                opt, max_lr=0.1, total_steps=6, cycle_momentum=cycle_momentum
            )
        return torch.optim.lr_scheduler.CyclicLR(
            opt, base_lr=0.01, max_lr=0.1, step_size_up=2, cycle_momentum=cycle_momentum
        )

    ours, ref = tiny_llama(), tiny_llama()
    opt = Lomo(ours, lr=0.1)
    with pytest.raises(ValueError, match="momentum"):
        scheduler(opt, cycle_momentum=True)
    sched = scheduler(opt)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_sched = scheduler(ref_opt)
    for step in range(5):
        opt.fused_backward(ours(**batch(step)).loss)
        sched.step()
        ref_opt.zero_grad()
        ref(**batch(step)).loss.backward()
        ref_opt.step()
        ref_sched.step()
        assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    assert max_rel_diff(ours, ref) <= 1e-6


def test_tied_parameters_updated_once():
    ours, ref = tiny_llama(tie_word_embeddings=True), tiny_llama(tie_word_embeddings=True)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    train_ours(ours, steps=3)
    train_sgd(ref, steps=3)
    assert max_rel_diff(ours, ref) <= 1e-6


def test_frozen_parameters_untouched():
    model = tiny_llama()
    frozen = model.model.layers[0].self_attn.q_proj.weight
    frozen.requires_grad_(False)
    before = frozen.clone()
    train_ours(model, steps=2)
    assert torch.equal(frozen, before)


def test_plain_backward_is_refused_with_explanation():
    model = tiny_llama()
    opt = Lomo(model, lr=0.1)  # held: a collected optimizer removes its hooks
    with pytest.raises(RuntimeError, match="build the optimizer with accumulation_steps=k"):
        model(**batch(0)).loss.backward()
    assert opt.attached


def test_step_is_a_no_op_and_closure_is_called():
    model = tiny_llama()
    opt = Lomo(model, lr=0.1)
    before = [p.clone() for p in model.parameters()]
    assert opt.step() is None
    assert opt.step(lambda: torch.tensor(3.0)).item() == 3.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_state_dict_resume_is_exact_fp16():
    # fp16 exercises the loss scaler state; resume must continue bit-identically.
    def run(model, opt, steps):
        for step in steps:
            opt.fused_backward(model(**batch(step)).loss, 0.05)

    straight = tiny_llama(torch.float16)
    opt = Lomo(straight, loss_scale_args={"init_scale": 2.0**20, "scale_window": 3})
    run(straight, opt, range(8))

    first = tiny_llama(torch.float16)
    opt1 = Lomo(first, loss_scale_args={"init_scale": 2.0**20, "scale_window": 3})
    run(first, opt1, range(4))
    saved_model = {k: v.clone() for k, v in first.state_dict().items()}
    saved_opt = opt1.state_dict()

    resumed = tiny_llama(torch.float16, seed=123)
    resumed.load_state_dict(saved_model)
    opt2 = Lomo(resumed)
    opt2.load_state_dict(saved_opt)
    assert opt2.loss_scaler.scale.item() == opt1.loss_scaler.scale.item()
    run(resumed, opt2, range(4, 8))
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_fp16_scale_grows_after_window_and_drops_on_overflow():
    """Window 2: the scale doubles after every second clean step; an overflow (step 4) halves
    it, skips the step and starts the window again (growth at step 6, not 5)."""
    model = tiny_llama(torch.float16)
    opt = Lomo(model, lr=0.01, loss_scale_args={"init_scale": 2.0**10, "scale_window": 2})
    counter = {"step": 0}
    poison(model.model.layers[0].mlp.up_proj.weight, {4}, counter)
    scales, skipped = [], []
    for step in range(7):
        counter["step"] = step
        opt.fused_backward(model(**batch(step)).loss)
        scales.append(opt.loss_scaler.scale.item())
        opt.flush_report()  # the step's outcome, read from the device
        skipped.append(opt.last_step_skipped)
    assert scales == [2.0**k for k in (10, 11, 11, 12, 11, 11, 12)]
    assert skipped == [False] * 4 + [True] + [False] * 2


def test_package_exports():
    assert lomo_kernels.Lomo is Lomo


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16_sr"])
def test_update_call_passes_each_argument_under_its_name(monkeypatch, dtype):
    """Every argument of Lomo's per-tensor update lands under its own name: the values are
    told apart (two group lrs, clip value 0.5 vs weight decay 0.25, distinct flag tensors,
    the loss scale's inverse, per-parameter seeds)."""
    recorded = record_lomo_calls(monkeypatch)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 20), torch.nn.Tanh(), torch.nn.Linear(20, 3))
    model.to(dtype)
    sr = dtype == torch.bfloat16
    opt = Lomo(
        model,
        lr=0.05,
        clip_grad_norm=1e-3,  # a coefficient below 1
        clip_grad_value=0.5,
        weight_decay=0.25,
        stochastic_rounding=sr,
        seed=3,
        param_groups=[{"params": [model[0].weight], "lr": 0.02}],
    )
    opt.fused_backward(model(torch.randn(5, 12).to(dtype)).float().pow(2).mean())
    calls = [args for op, args in recorded if op == "lomo_update_"]
    params = list(model.parameters())
    assert [id(c["param"]) for c in calls] == [id(p) for p in reversed(params)]
    scalars = opt._scalars[params[0].device]
    for call in calls:
        param = call["param"]
        index = next(i for i, p in enumerate(params) if p is param)  # its seed's
        assert call["grad"].shape == param.shape and call["grad"].is_contiguous()
        lr = 0.02 if param is model[0].weight else 0.05
        assert call["lr"].item() == torch.tensor(lr).item()
        if sr:
            assert call["inv_scale"] is None
        else:
            assert call["inv_scale"] is opt.loss_scaler.inv_scale
        assert call["clip_value"] == 0.5
        assert call["clip_coef"].item() == opt.clip_coef.item() < 1.0
        assert call["weight_decay"] == 0.25
        assert call["found_inf"] is scalars.update_found_inf
        assert call["skip_if"] is scalars.norm_found_inf
        assert call["stochastic_rounding"] is sr
        assert call["seed"] == (parameter_seed(index) if sr else 0)
        assert call["seed_step"] is (opt.rounding.seed_step(param.device) if sr else None)
        assert call["offset"] == 0  # a whole parameter
