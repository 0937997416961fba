"""single_backward=True: one backward per step, the clip rule's bound, partial fp16 steps."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from support.adalomo import check_param
from support.faults import poison
from support.float64 import U32
from support.host_sync import train_without_host_sync
from support.models import batch, clone, tiny_llama
from support.sharded_checks import count_phases
from support.state import snapshot
from torch.utils._python_dispatch import TorchDispatchMode

from lomo_kernels import AdaLomo, Lomo
from lomo_kernels.optim.single_backward import SingleBackwardClip

MAX_NORM = 0.5


def true_grads(model, loss_fn) -> list[torch.Tensor]:
    """Per-parameter fp64 gradients of a copy of `model` (no optimizer attached)."""
    copy = clone(model)
    loss_fn(copy).backward()
    return [p.grad.double() for p in copy.parameters()]


def applied_update(model, before, lr) -> torch.Tensor:
    """The clipped gradient Lomo applied (lr given, no weight decay): flat fp64."""
    return torch.cat(
        [
            ((b.double() - p.detach().double()) / lr).reshape(-1)
            for p, b in zip(model.parameters(), before, strict=True)
        ]
    )


@pytest.mark.parametrize("cls", [Lomo, AdaLomo])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_one_backward_per_step(cls, dtype):
    model = tiny_llama(dtype)
    opt = cls(model, lr=0.01, clip_grad_norm=1.0, single_backward=True)
    phases = count_phases(opt)
    for step in range(3):
        opt.fused_backward(model(**batch(step)).loss)
    assert phases == ["update"] * 3
    exact = cls(tiny_llama(dtype), lr=0.01, clip_grad_norm=1.0)
    phases = count_phases(exact)
    exact.fused_backward(exact.model(**batch(0)).loss)
    assert phases == ["norm", "update"]  # the default stays lomo-optim's two passes


@pytest.mark.parametrize("cls", [Lomo, AdaLomo])
@pytest.mark.parametrize(
    "dtype,clip",
    [(torch.float16, None), (torch.float16, 1.0), (torch.bfloat16, 1.0), (torch.float32, 1.0)],
    ids=["fp16", "fp16_clip", "bf16_clip", "fp32_clip"],
)
def test_no_host_sync_in_single_backward(cls, dtype, clip):
    model, opt = train_without_host_sync(
        cls, dtype, lr=0.01, clip_grad_norm=clip, single_backward=True
    )
    opt.flush_report()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def spike_loss(step, factor):
    return lambda m: m(**batch(step)).loss * factor


@pytest.mark.parametrize("factor", [1.0, 1e4], ids=["plain", "spike"])
def test_applied_norm_within_the_stated_bound(factor):
    """||applied|| <= M sqrt(1 + 2 ln(||g|| / Q)), Q = max(P, ||g_first||), at every step."""
    lr = 1e-3
    model = tiny_llama(torch.float32)
    opt = Lomo(model, lr=lr, clip_grad_norm=MAX_NORM, single_backward=True)
    for step in range(4):
        loss_fn = spike_loss(step, factor if step == 2 else 1.0)
        grads = true_grads(model, loss_fn)
        norm = math.sqrt(sum((g * g).sum().item() for g in grads))
        # The first gradient to arrive is one of the parameters': min over them bounds Q below.
        q = max(
            opt._single_backward_clip.previous.item() if step else 0.0,
            min(g.norm().item() for g in grads),
        )
        before = snapshot(model)
        opt.fused_backward(loss_fn(model))
        applied = applied_update(model, before, lr).norm().item()
        bound = (
            MAX_NORM * math.sqrt(1 + 2 * math.log(norm / q)) if norm > q else MAX_NORM * norm / q
        )
        assert applied <= bound * 1.001 + 1e-6, (step, applied, bound)
        assert applied <= norm * 1.001
        # `norm` is float64 from the same gradients; ours sums each tensor in float64, rounds
        # it to fp32 and adds K per-tensor sums in fp32: (K + 2) roundings of the sum of
        # squares, half that relative in the norm, + the sqrt's: within (K + 6) / 2 u, held
        # to (K + 6) u (K = 21 here: 1.6e-6; seen on AVX2: 1.6 u).
        k = len(list(model.parameters()))
        assert opt.last_grad_norm.item() == pytest.approx(norm, rel=(k + 6) * U32)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_known_norm_gives_exact_direction():
    """When P >= ||g||, every tensor gets min(1, M / P): exact clipping's direction."""
    lr = 1.0  # large enough that the fp32 rounding of the parameters does not hide the step
    model = tiny_llama(torch.float32)
    opt = Lomo(model, lr=lr, clip_grad_norm=MAX_NORM, single_backward=True)
    opt.fused_backward(model(**batch(0)).loss)
    grads = true_grads(model, spike_loss(1, 1.0))
    norm = math.sqrt(sum((g * g).sum().item() for g in grads))
    big = 3.0 * norm
    opt._single_backward_clip.norm_history.fill_(big)
    before = snapshot(model)
    opt.fused_backward(model(**batch(1)).loss)
    expected = torch.cat([g.reshape(-1) for g in grads]) * (MAX_NORM / (big + 1e-6))
    got = applied_update(model, before, lr)
    # The write rounds p - lr * c * g to fp32 once: got is off by <= 1/2 ulp of the new
    # parameter (<= U32 * max|p|, lr = 1), and c is fp32 (2 roundings: 2 U32 * |expected|).
    # Held to twice that (seen on AVX2: 1/2 ulp of 1.0 = 6e-8).
    largest = max(b.abs().max().item() for b in before)
    torch.testing.assert_close(got, expected, rtol=4 * U32, atol=2 * U32 * largest)


def test_first_step_and_history():
    """First step: running-norm guard only; P = the median of the last three clean norms."""
    model = tiny_llama(torch.float32)
    opt = Lomo(model, lr=1e-3, clip_grad_norm=MAX_NORM, single_backward=True)
    norms = []
    for step in range(3):
        factor = 100.0 if step == 1 else 1.0
        opt.fused_backward(model(**batch(step)).loss * factor)
        norms.append(opt.last_grad_norm.item())
        opt._single_backward_clip.begin_step()  # what the next step does first: computes P
        if step == 0:
            assert opt._single_backward_clip.previous.item() == pytest.approx(norms[0])
        else:
            # The first clean norm fills the history; the spike (step 1) is outvoted.
            padded = (norms + [norms[0]] * 3)[:3]
            assert opt._single_backward_clip.previous.item() == pytest.approx(sorted(padded)[1])
    # The spike (step 1) does not set P for step 2: the clean norm of step 0 does.
    assert norms[1] > 50 * norms[0]
    # state_dict carries the history.
    fresh = Lomo(clone(model), lr=1e-3, clip_grad_norm=MAX_NORM, single_backward=True)
    fresh.load_state_dict(opt.state_dict())
    assert torch.equal(
        fresh._single_backward_clip.norm_history, opt._single_backward_clip.norm_history
    )


def norm_weights(model) -> list[str]:
    return [n for n, _ in model.named_parameters() if "norm" in n]


def test_fp16_inf_in_one_layer_is_a_partial_step():
    model = tiny_llama(torch.float16)
    opt = Lomo(
        model,
        lr=0.05,
        clip_grad_norm=1.0,
        loss_scale_args={"init_scale": 2.0**10},
        single_backward=True,
    )
    target = model.model.layers[1].mlp.down_proj.weight
    counter = {"step": 0}
    poison(target, {1}, counter)
    phases = count_phases(opt)
    history = opt._single_backward_clip.norm_history
    for step in range(5):
        counter["step"] = step
        before, scale_before = snapshot(model), opt.loss_scaler.scale.item()
        history_before = history.clone()
        opt.fused_backward(model(**batch(step)).loss)
        # A clean step's norm enters the history P is the median of; a partial step's
        # (measured without the tensor left out) does not.
        assert torch.equal(history, history_before) == (step == 1)
        assert all(torch.isfinite(p).all() for p in model.parameters())
        moved = [not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True)]
        index = [id(p) for p in model.parameters()].index(id(target))
        if step == 1:
            assert torch.equal(target, before[index])
            # The rest of the step was applied (fp16 norm weights near 1 may round back).
            assert sum(moved) >= len(moved) - 1 - len(norm_weights(model))
            assert opt.loss_scaler.scale.item() == scale_before / 2
            with pytest.warns(RuntimeWarning, match="1 tensor.*left unchanged whole.*partial"):
                opt.flush_report()
            assert opt.last_step_partial and not opt.last_step_skipped
        else:
            assert moved[index] and sum(moved) >= len(moved) - len(norm_weights(model))
            opt.flush_report()
            assert not opt.last_step_partial
    assert phases == ["update"] * 5


def test_adalomo_fp16_inf_leaves_tensor_and_moments_unchanged():
    model = tiny_llama(torch.float16)
    opt = AdaLomo(model, lr=0.01, clip_grad_norm=1.0, single_backward=True)
    target = model.model.layers[0].self_attn.q_proj.weight
    counter = {"step": 0}
    poison(target, {1}, counter)
    for step in range(3):
        counter["step"] = step
        before = target.detach().clone()
        moments = {k: v.clone() for k, v in opt.state[target].items()}
        opt.fused_backward(model(**batch(step)).loss)
        assert all(torch.isfinite(p).all() for p in model.parameters())
        if step == 1:
            assert torch.equal(target, before)
            assert all(torch.equal(opt.state[target][k], v) for k, v in moments.items())
            with pytest.warns(RuntimeWarning, match="partial"):
                opt.flush_report()
            assert opt.last_step_partial
        else:
            assert not torch.equal(target, before)


def test_bucket_rule_equals_per_tensor_rule():
    """prepare_bucket (sharded) on two "ranks" halves gives prepare's coefficients and skips."""
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=gen) * s for n, s in ((7, 0.1), (5, 3.0), (9, 0.5), (4, 1))]
    grads[2][3] = float("inf")
    grads[3][0] = float("nan")  # two skipped tensors in one bucket: both counted
    whole = SingleBackwardClip(MAX_NORM, torch.device("cpu"))
    sharded = SingleBackwardClip(MAX_NORM, torch.device("cpu"))
    for state in (whole, sharded):
        state.norm_history.fill_(0.7)
        state.begin_step()
    expected_coefs, expected_skips = [], []
    for g in grads:
        coef = torch.zeros(1)
        expected_skips.append(whole.prepare(g, None, "torch", coef).item())
        expected_coefs.append(coef.item())

    halves = [[g[: len(g) // 2] for g in grads], [g[len(g) // 2 :] for g in grads]]
    other = {}

    def all_reduce_sum_(t):  # "rank 0" adds "rank 1"'s measurement of the other halves
        t.add_(other["sums"])

    for rank in (1, 0):
        probe = SingleBackwardClip(MAX_NORM, torch.device("cpu"))
        if rank == 1:  # only its measurement is needed
            probe.prepare_bucket(halves[1][:2], None, "torch", lambda t: other.update(a=t.clone()))
            probe.prepare_bucket(halves[1][2:], None, "torch", lambda t: other.update(b=t.clone()))
            continue
        coefs, skips = [], []
        for part, key in ((slice(0, 2), "a"), (slice(2, 4), "b")):
            other["sums"] = other[key]
            c, k = sharded.prepare_bucket(halves[0][part], None, "torch", all_reduce_sum_)
            coefs += c.tolist()
            skips += k.tolist()
    assert skips == expected_skips == [0, 0, 1, 1]
    assert sharded.step_found.item() == whole.step_found.item() == 2
    # S_i: the same finite sums of squares, each split in two halves added after rounding:
    # one more rounding per tensor, (count + 2) u on S, half that on sqrt(S), 2 more for the
    # coefficient; held to twice (count + 4) u.
    rtol = 2 * (len(grads) + 4) * U32
    torch.testing.assert_close(sharded.step_sumsq, whole.step_sumsq, rtol=rtol, atol=0)
    torch.testing.assert_close(torch.tensor(coefs), torch.tensor(expected_coefs), rtol=rtol, atol=0)


def test_grad_norm_then_fused_backward_stays_exact():
    """An explicit grad_norm(loss) still gives that step exact clipping."""
    a, b = tiny_llama(), tiny_llama()
    single = Lomo(a, lr=0.05, clip_grad_norm=MAX_NORM, single_backward=True)
    exact = Lomo(b, lr=0.05, clip_grad_norm=MAX_NORM)
    for model, opt in ((a, single), (b, exact)):
        loss = model(**batch(0)).loss
        opt.grad_norm(loss)
        opt.fused_backward(loss)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


# ----------------------------------------------------------------------------- AdaLomo pass A


class GradSumsqRoute(AdaLomo):
    """AdaLomo measuring every gradient with grad_sumsq_ before its update (`prepare` and
    skip_if), as 1-D tensors are: an independent measurement of the same S_i."""

    def _update_measures(self, param, grad):
        return False


def record_measurements(opt) -> list[torch.Tensor]:
    """[coefficient, skip flag, counted sum of squares] of each gradient, in arrival order."""
    records: list[torch.Tensor] = []
    account = opt._single_backward_clip._account

    def recording(pair, sumsq, found, bad, clip_coef):
        account(pair, sumsq, found, bad, clip_coef)
        records.append(torch.cat([clip_coef, found, sumsq]).double())

    opt._single_backward_clip._account = recording
    return records


class RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_adalomo_factored_gradients_are_read_once_for_their_norm():
    """single_backward: grad_sumsq_ runs for the 1-D tensors only; factored tensors are
    measured by their pass A (one factored_stats_ each)."""
    model = tiny_llama(torch.bfloat16)
    opt = AdaLomo(model, lr=0.01, clip_grad_norm=1.0, single_backward=True)
    recorder = RecordOps()
    with recorder:
        opt.fused_backward(model(**batch(0)).loss)
    dims = [p.dim() for p in model.parameters()]
    assert recorder.names.count("lomo_kernels.grad_sumsq_.default") == dims.count(1) > 0
    stats = recorder.names.count("lomo_kernels.adalomo_factored_stats_.default")
    assert stats == len(dims) - dims.count(1) > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_adalomo_pass_a_route_equals_grad_sumsq_route(backend, dtype):
    """Coefficients, skips, step norms and updates equal those of the grad_sumsq_ route.

    Both optimizers start every step from the same parameters, moments and norm history, so
    they differ only in how each tensor's sum of squares is measured. Either measurement is
    within (n + 2) U32 of the exact sum for a tensor of n elements (fp32 squares summed in any
    order, one final rounding), and S_i adds at most `count` such values, so S_i and then
    sqrt(S_i), hence the coefficients and the norms, agree to (n_max + count + 4) U32. Step 2
    is a spike (coefficients differ from tensor to tensor, and from step 3 on the moments
    keep part of it), step 3 has an inf in one factored gradient (the tensor is skipped and
    not counted).
    """
    model = tiny_llama(dtype)
    reference_model = clone(model)
    counter = {"step": 0}
    for m in (model, reference_model):
        poison(m.model.layers[0].self_attn.q_proj.weight, {3}, counter)
    target = model.model.layers[0].self_attn.q_proj.weight
    kwargs = {"lr": 0.01, "clip_grad_norm": MAX_NORM, "weight_decay": 0.01, "backend": backend}
    opt = AdaLomo(model, single_backward=True, **kwargs)
    reference = GradSumsqRoute(reference_model, single_backward=True, **kwargs)
    params = list(model.parameters())
    count, n_max = len(params), max(p.numel() for p in params)
    rel = (n_max + count + 4) * U32
    ours, theirs = record_measurements(opt), record_measurements(reference)
    index = [id(p) for p in params].index(id(target))
    for step in range(5):
        counter["step"] = step
        reference_model.load_state_dict(model.state_dict())
        reference.load_state_dict(opt.state_dict())
        before = snapshot(model)
        ours.clear(), theirs.clear()
        factor = 30.0 if step == 2 else 1.0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # step 3 is partial: reported, expected
            for m, o in ((model, opt), (reference_model, reference)):
                o.fused_backward(m(**batch(step)).loss * factor)
                o.flush_report()
        assert len(ours) == len(theirs) == count
        mine, ref = torch.stack(ours), torch.stack(theirs)
        assert torch.equal(mine[:, 1], ref[:, 1])  # the same tensors skipped
        assert mine[:, 1].sum().item() == (1.0 if step == 3 else 0.0)
        torch.testing.assert_close(mine[:, 2], ref[:, 2], rtol=2 * rel, atol=0)
        torch.testing.assert_close(mine[:, 0], ref[:, 0], rtol=rel, atol=0)
        if step == 2:
            assert mine[:, 0].max() > 1.5 * mine[:, 0].min()  # per-tensor coefficients
        torch.testing.assert_close(opt.last_grad_norm, reference.last_grad_norm, rtol=rel, atol=0)
        assert opt.last_step_partial == reference.last_step_partial == (step == 3)
        for i, (p, b, q) in enumerate(
            zip(params, before, reference_model.parameters(), strict=True)
        ):
            ref_p = q.detach().double().reshape(-1)
            check_param(p.detach(), ref_p, b, (b.double().reshape(-1) - ref_p).abs(), dtype)
            if step == 3 and i == index:
                assert torch.equal(p, b)
