"""Gradient accumulation (`accumulation_steps=k`): k micro-batches equal one step on their
concatenation, against torch's own accumulation + clip_grad_norm_ + SGD (Lomo) and against
the big batch (AdaLomo); nothing changes before the k-th micro-batch; what cannot be served
is refused before any change."""

from __future__ import annotations

import warnings

import pytest
import torch
from support.accumulating import FP32_BOUND, STEPS, K, micro_batches, piece_of, train_accumulating
from support.float64 import ulp
from support.models import batch, max_rel_diff, tiny_llama
from support.recording import record_lomo_calls
from support.state import assert_refused, same_bits, snapshot, tensors, unchanged

from lomo_kernels import AdaLomo, Lomo


def train_torch_accumulation(model, lr, steps=STEPS, k=K, clip=None, weight_decay=0.0):
    sgd = torch.optim.SGD(model.parameters(), lr=lr, weight_decay=weight_decay)
    for step in range(steps):
        for micro in micro_batches(step, k):
            (model(**micro).loss / k).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        sgd.step()
        sgd.zero_grad(set_to_none=True)


@pytest.mark.parametrize("clip", [None, 0.5])
def test_lomo_equals_torch_accumulation(backend, clip):
    ours, ref = tiny_llama(), tiny_llama()
    opt = Lomo(ours, lr=0.05, clip_grad_norm=clip, accumulation_steps=K, backend=backend)
    train_accumulating(ours, opt)
    train_torch_accumulation(ref, 0.05, clip=clip)
    assert opt.step_count == STEPS
    assert max_rel_diff(ours, ref) <= FP32_BOUND


@pytest.mark.parametrize("k", [1, K])
def test_a_gradient_left_from_before_is_not_summed_in(k):
    """A `.grad` left on the parameters (a loop switched from another optimizer without
    zero_grad, a gradient set by hand) is dropped by the step's first call, not summed into
    its first micro-batch (or its only one): the step equals that of a model without it."""
    ours, ref = tiny_llama(), tiny_llama()
    for p in ours.parameters():
        p.grad = torch.full_like(p, 1e3)
    opts = [Lomo(model, lr=0.05, accumulation_steps=k) for model in (ours, ref)]
    for model, opt in zip((ours, ref), opts, strict=True):
        for micro in micro_batches(0, k):
            opt.fused_backward(model(**micro).loss / k)
    assert all(opt.step_count == 1 for opt in opts)
    assert all(p.grad is None for p in ours.parameters())
    assert max_rel_diff(ours, ref) == 0.0


def test_lomo_weight_decay_and_clip_value_on_the_accumulated_gradient(backend):
    # torch: clip_grad_value_ and SGD's coupled decay act on the summed .grad once.
    ours, ref = tiny_llama(), tiny_llama()
    opt = Lomo(ours, lr=0.05, weight_decay=0.1, clip_grad_value=0.002, accumulation_steps=K,
               backend=backend)  # fmt: skip
    train_accumulating(ours, opt)
    sgd = torch.optim.SGD(ref.parameters(), lr=0.05)
    for step in range(STEPS):
        for micro in micro_batches(step):
            (ref(**micro).loss / K).backward()
        torch.nn.utils.clip_grad_value_(ref.parameters(), 0.002)
        with torch.no_grad():  # Lomo's decay: p * (1 - lr * wd) - lr * g
            for p in ref.parameters():
                p.mul_(1 - 0.05 * 0.1)
        sgd.step()
        sgd.zero_grad(set_to_none=True)
    assert max_rel_diff(ours, ref) <= FP32_BOUND


@pytest.mark.parametrize("clip", [None, 0.3])
def test_adalomo_equals_its_big_batch_step(backend, clip):
    # AdaLomo's factored second moment of the accumulated gradient is that of the big batch's
    # gradient: the same sum of the same per-sequence terms, in another order (fp32 rounding).
    ours, ref = tiny_llama(), tiny_llama()
    opt = AdaLomo(ours, lr=1e-3, clip_grad_norm=clip, accumulation_steps=K, backend=backend)
    big = AdaLomo(ref, lr=1e-3, clip_grad_norm=clip, backend=backend)
    train_accumulating(ours, opt)
    for step in range(STEPS):
        big.fused_backward(ref(**batch(step, batch_size=2 * K)).loss)
    # AdaLomo's update is normalised by its RMS, so a rounding-level change of the gradient
    # moves the update by a rounding-level relative amount too: the same fp32 bound.
    assert max_rel_diff(ours, ref) <= FP32_BOUND
    # The update hides a gradient scaled alike at every step: the second moments (the
    # gradient's squares) are compared too, and clipped, the norm.
    for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
        for name, moment in opt.state[p].items():
            other = big.state[q][name]
            assert (moment - other).abs().max() <= FP32_BOUND * other.abs().max(), name
    if clip is not None:  # the accumulated gradient was clipped
        assert float(opt.last_grad_norm) > clip
        assert abs(float(opt.last_grad_norm) / float(big.last_grad_norm) - 1) <= FP32_BOUND


def test_nothing_changes_before_the_last_micro_batch_and_no_grad_is_kept(backend):
    model = tiny_llama()
    opt = Lomo(model, lr=0.05, clip_grad_norm=1.0, accumulation_steps=K, backend=backend)
    start = snapshot(model)
    for i, micro in enumerate(micro_batches(0)):
        opt.fused_backward(model(**micro).loss / K)
        assert all(p.grad is None for p in model.parameters())
        if i < K - 1:
            assert unchanged(model, start) and opt.step_count == 0
            assert opt.pending_micro_batches == i + 1
    assert not unchanged(model, start) and opt.step_count == 1
    assert opt.pending_micro_batches == 0
    assert torch.isfinite(opt.last_grad_norm).all()


def test_the_step_reports_each_accumulated_gradients_norm():
    # As after a norm pass: grad_norms holds each parameter's accumulated gradient's norm (in
    # model order), whose 2-norm is last_grad_norm; torch's summed .grad is the reference.
    ours, ref = tiny_llama(), tiny_llama()
    opt = Lomo(ours, lr=0.05, clip_grad_norm=1.0, accumulation_steps=K)
    train_accumulating(ours, opt, steps=1)
    for micro in micro_batches(0):
        (ref(**micro).loss / K).backward()
    expected = torch.stack([p.grad.double().norm() for p in ref.parameters()])
    norms = opt.grad_norms.double()
    assert norms.shape == expected.shape
    # fp32 sums of squares of the same fp32 values in another order: FP32_BOUND relative.
    assert ((norms - expected).abs() <= FP32_BOUND * expected.max()).all()
    assert abs(norms.norm().item() / float(opt.last_grad_norm) - 1) <= FP32_BOUND


def test_one_micro_batch_per_step_is_the_default_step():
    # accumulation_steps=1 builds the default optimizer: no accumulation at all (no buffer,
    # every call a step), whose steps equal it bit for bit. That step's own behaviour is
    # what the rest of the suite checks against torch, float64 and lomo-optim.
    a, b = tiny_llama(), tiny_llama()
    plain = Lomo(a, lr=0.05, clip_grad_norm=1.0)
    explicit = Lomo(b, lr=0.05, clip_grad_norm=1.0, accumulation_steps=1)
    for step in range(2):
        plain.fused_backward(a(**batch(step)).loss)
        explicit.fused_backward(b(**batch(step)).loss)
    assert explicit.accumulation_steps == 1 and explicit.pending_micro_batches == 0
    assert explicit._accumulation is None and explicit.step_count == 2
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_a_parameter_without_a_gradient_in_some_micro_batches():
    # The second layer's output is used in the even micro-batches of the first step only:
    # its buffer keeps what it has within that step, and in the second step, which gives it
    # no gradient, its buffer (kept from the first) is neither applied nor measured. The
    # steps equal torch's (whose .grad simply gets fewer terms, or none).
    def make():
        torch.manual_seed(0)
        return torch.nn.ModuleList([torch.nn.Linear(6, 5), torch.nn.Linear(6, 5)])

    def loss_of(model, step, i):
        x = torch.randn(3, 6, generator=torch.Generator().manual_seed(10 * step + i))
        out = model[0](x)
        if step == 0 and i % 2 == 0:
            out = out + model[1](x)
        return out.pow(2).mean() / K

    ours, ref = make(), make()
    opt = Lomo(ours, lr=0.1, clip_grad_norm=0.3, accumulation_steps=K)
    sgd = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        for i in range(K):
            opt.fused_backward(loss_of(ours, step, i))
            loss_of(ref, step, i).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3)
        sgd.step()
        sgd.zero_grad(set_to_none=True)
    assert opt.step_count == 2
    assert max_rel_diff(ours, ref) <= FP32_BOUND


class LayerInTwoSegments(torch.nn.Module):
    """One layer applied in two checkpoint segments: reentrant ones each run a backward of
    their own, so the layer's gradient reaches its hook in two parts."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer, self.head = torch.nn.Linear(6, 6), torch.nn.Linear(6, 3)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            x = torch.utils.checkpoint.checkpoint(
                lambda t: torch.tanh(self.layer(t)), x, use_reentrant=self.reentrant
            )
        return self.head(x).pow(2).mean()


@pytest.mark.parametrize("optimizer", [Lomo, AdaLomo])
def test_a_gradient_in_parts_is_accumulated_whole(optimizer):
    # A one-batch step refuses a gradient in parts (it would step the layer twice); a
    # micro-batch adds both parts into the buffer, and the measuring one counts the buffer
    # once: the step equals the same model's whose gradients arrive whole (non-reentrant
    # segments), with the same norm. The two add the same fp32 parts in another order.
    lr = 0.05 if optimizer is Lomo else 1e-3
    runs = []
    for reentrant in (True, False):
        model = LayerInTwoSegments(reentrant)
        opt = optimizer(model, lr=lr, clip_grad_norm=0.1, weight_decay=0.1, accumulation_steps=K)
        for step in range(2):
            for i in range(K):
                gen = torch.Generator().manual_seed(10 * step + i)
                x = torch.randn(5, 6, generator=gen).requires_grad_()
                opt.fused_backward(model(x) / K)
        runs.append((model, opt))
    (parts, parts_opt), (whole, whole_opt) = runs
    assert parts_opt.step_count == 2
    assert max_rel_diff(parts, whole) <= FP32_BOUND
    assert abs(float(parts_opt.last_grad_norm) / float(whole_opt.last_grad_norm) - 1) <= FP32_BOUND


@pytest.mark.parametrize("clip", [None, 0.5])
def test_step_applies_a_short_step(clip):
    # The last step of an epoch with fewer than k micro-batches left (transformers' Trainer):
    # opt.step() applies what was accumulated, as torch's step() applies the summed .grad;
    # unclipped, a sum scaled by any factor would show (clipped, the norm does).
    ours, ref = tiny_llama(), tiny_llama()
    opt = Lomo(ours, lr=0.05, clip_grad_norm=clip, accumulation_steps=K)
    micros = micro_batches(0)[:2]
    for micro in micros:
        opt.fused_backward(ours(**micro).loss / 2)
    assert opt.step_count == 0 and opt.pending_micro_batches == 2
    opt.step()
    assert opt.step_count == 1 and opt.pending_micro_batches == 0
    after = snapshot(ours)
    opt.step()  # nothing pending: a no-op, as after a full step
    assert opt.step_count == 1 and unchanged(ours, after)
    sgd = torch.optim.SGD(ref.parameters(), lr=0.05)
    for micro in micros:
        (ref(**micro).loss / 2).backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip or float("inf"))
    sgd.step()
    assert max_rel_diff(ours, ref) <= FP32_BOUND
    if clip is not None:
        assert norm > clip  # the clip binds
        assert abs(float(opt.last_grad_norm) / float(norm) - 1) <= FP32_BOUND


def test_zero_grad_drops_the_accumulated_micro_batches():
    model = tiny_llama()
    opt = Lomo(model, lr=0.05, accumulation_steps=K)
    start = snapshot(model)
    opt.fused_backward(model(**micro_batches(0)[0]).loss)
    opt.zero_grad()
    assert opt.pending_micro_batches == 0
    opt.step()
    assert unchanged(model, start) and opt.step_count == 0


def test_fp16_overflow_in_one_micro_batch_skips_the_whole_step():
    # torch's GradScaler: one scale for the k micro-batches; an inf in any skips the step and
    # lowers the scale once.
    model = tiny_llama(torch.float16)
    opt = Lomo(model, lr=0.05, clip_grad_norm=1.0, accumulation_steps=K)
    scale = opt.loss_scaler.loss_scale
    before = tensors(model, opt)
    micros = micro_batches(0)
    for i, micro in enumerate(micros):
        loss = model(**micro).loss / K
        opt.fused_backward(loss * float("inf") if i == 1 else loss)
    assert same_bits(before[: len(list(model.parameters()))], snapshot(model))
    assert opt.loss_scaler.loss_scale == scale / 2
    assert opt.step_count == 1 and opt.pending_micro_batches == 0
    opt.flush_report()
    assert opt.last_step_skipped
    # The next step trains from clean buffers.
    start = snapshot(model)
    for micro in micros:
        opt.fused_backward(model(**micro).loss / K)
    assert not unchanged(model, start)


@pytest.mark.parametrize("bad", [1, K - 1])
@pytest.mark.parametrize("clip", [None, 0.5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("optimizer", [Lomo, AdaLomo])
def test_overflow_in_any_micro_batch_skips_the_whole_step(optimizer, dtype, clip, bad):
    # Without clipping or fp16 a one-batch step leaves only the non-finite elements out; an
    # accumulated step knows every micro-batch's flag before it writes anything, so an inf in
    # any (an early one, or the last, measuring one) skips it whole, as torch's GradScaler
    # does, and says so: no parameter or moment changes, with or without clipping.
    model = tiny_llama(dtype)
    opt = optimizer(model, lr=0.05, clip_grad_norm=clip, accumulation_steps=K)
    before = tensors(model, opt)
    for i, micro in enumerate(micro_batches(0)):
        loss = model(**micro).loss / K
        opt.fused_backward(loss * float("inf") if i == bad else loss)
    assert same_bits(before, tensors(model, opt))
    assert opt.step_count == 1 and opt.pending_micro_batches == 0
    with pytest.warns(RuntimeWarning, match="skipped whole"):
        opt.flush_report()
    assert opt.last_step_skipped and not opt.last_step_partial


@pytest.mark.parametrize("clip", [None, 0.5])
def test_fp16_accumulation_is_the_exact_step_of_its_gradients_within_fp16_rounding(clip):
    # fp16 weights and fp16 loss-scaled buffers rounded to nearest, against a float64 model
    # fed the gradients each micro-batch's backward hands the optimizer (a tensor hook's
    # copies: the fp16 forward's own rounding is torch's and the same on both sides): summed,
    # unscaled, clipped and applied exactly. Per element the step is within what the
    # package's roundings can move it:
    # - each of the K writes of the buffer rounds the fp32 sum of the stored value and the
    #   gradient (2**-24 relative) to fp16 (half an ulp): the stored sum is within e of the
    #   exact one x, e adding the writes' errors, each ulp taken at |x| + e (the largest the
    #   stored value can be; the first write, of an fp16 gradient, is exact but counted);
    # - clipping reads the stored sum's norm, within ||e|| of the exact one: a relative error
    #   of the coefficient of at most delta, ||e|| / (||x|| - ||e||) plus fp32's few roundings
    #   of the norm (2**-20);
    # - the update's products and subtraction in fp32: a few 2**-24 of |p| + |update|;
    # - the write-back's rounding to fp16: half an ulp of the result.
    # The writes' half ulps are 2**-12 of the sum each: ~1e-3 of the update after K = 4 (with
    # clipping twice that, delta adding as much), where a micro-batch's gradient mis-added by
    # 5% moves it by ~1e-2.
    lr = 0.05
    model = tiny_llama(torch.float16)
    params = list(model.parameters())
    start = [p.detach().double().reshape(-1) for p in params]
    opt = Lomo(model, lr=lr, clip_grad_norm=clip, accumulation_steps=K, stochastic_rounding=False)
    grads: list[list[torch.Tensor]] = [[] for _ in params]
    for p, seen in zip(params, grads, strict=True):
        p.register_hook(lambda g, seen=seen: seen.append(g.double().reshape(-1)))
    inv_scale = 1 / opt.loss_scaler.loss_scale  # a power of two: exact
    train_accumulating(model, opt, steps=1)
    opt.flush_report()
    assert opt.step_count == 1 and not opt.last_step_skipped
    sums, errors = [], []
    for seen in grads:
        assert len(seen) == K
        x, e = torch.zeros_like(seen[0]), torch.zeros_like(seen[0])
        for g in seen:
            x = x + g  # exact: fp16 values are multiples of 2**-24 below 2**16
            magnitude = (x.abs() + e) * (1 + 2**-23)
            e = e + ulp(magnitude, torch.float16) / 2 + 2**-24 * magnitude
        sums.append(x)
        errors.append(e)
    norm = inv_scale * torch.cat(sums).norm().item()
    coef, delta = 1.0, 0.0
    if clip is not None:
        error = inv_scale * torch.cat(errors).norm().item()
        coef, delta = clip / (norm + 1e-6), error / (norm - error) + 2**-20
        assert norm > 1.5 * clip  # the coefficient clips, well away from its clamp at 1
    sensitive = 0
    names = [name for name, _ in model.named_parameters()]
    for name, p, s, x, e in zip(names, params, start, sums, errors, strict=True):
        update = lr * coef * inv_scale * x
        ref = s - update
        summed = lr * coef * inv_scale * (1 + delta) * (e + delta * x.abs())
        fp32 = 2**-22 * (s.abs() + update.abs())
        bound = summed + fp32 + ulp(ref.abs() + summed + fp32, torch.float16) / 2
        assert ((p.detach().double().reshape(-1) - ref).abs() / bound).max().item() <= 1, name
        sensitive += bool((bound < 0.01 * update.abs()).any())
    # Not vacuous: a 1% error of the update exceeds the bound somewhere in a quarter of the
    # tensors at least (12 to 16 of the 21, measured; the rest move by less than the
    # write-back's half ulp).
    assert sensitive >= len(params) // 4


@pytest.mark.parametrize("dtype", [None, torch.float32, torch.int8])
def test_bf16_buffer_keeps_additions_below_half_an_ulp(dtype):
    # A bf16 buffer gets 1.0, then 15 additions of 1e-3: each is an eighth of bf16's ulp at 1
    # (2**-7), so round-to-nearest would keep 1.0 and lose 0.015; stochastic rounding keeps
    # the sum in expectation. A stochastic rounding to a grid of step u adds an error of mean
    # 0 and variance at most u**2 / 4, independent from rounding to rounding (each
    # micro-batch draws its own bits), so an element's variance is at most the sum over its
    # roundings: 15 additions of step 2**-7 and the bf16 write-back; the 8-bit buffer's
    # additions of step 2**-6 (1.0's block scale); an fp32 buffer's write-back alone. The
    # mean over 2**16 elements then has a standard deviation of at most sqrt(variance /
    # 2**16): allowed 6 sigma. The elements' sample variance (within 1% of the true one
    # over 2**16 samples) is bounded too: bits shared between micro-batches would add up
    # coherently and exceed it.
    n, k = 1 << 16, 16
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(torch.zeros(n, dtype=torch.bfloat16))
    opt = Lomo(module, lr=1.0, accumulation_steps=k, accumulation_dtype=dtype)
    small = torch.tensor(1e-3, dtype=torch.bfloat16).item()  # the gradient as bf16 holds it
    for i in range(k):
        opt.fused_backward(module.weight.float().sum() * (1.0 if i == 0 else small))
    expected = -(1.0 + (k - 1) * small)  # lr 1 from 0: the weight is minus the sum
    buffer_step = {None: 2**-7, torch.float32: 0.0, torch.int8: 2**-6}[dtype]
    variance = ((k - 1) * buffer_step**2 + (2**-7) ** 2) / 4
    weight = module.weight.double()
    assert abs(weight.mean().item() - expected) <= 6 * (variance / n) ** 0.5
    assert weight.var().item() <= variance


def test_accumulation_buffer_dtype_and_memory():
    # bf16 parameters get bf16 buffers by default (two bytes each), fp32 ones with
    # accumulation_dtype=torch.float32 (four).
    model = tiny_llama(torch.bfloat16)
    opt = Lomo(model, lr=0.05, accumulation_steps=K)
    opt.fused_backward(model(**micro_batches(0)[0]).loss)
    params = sum(p.numel() for p in model.parameters())
    assert {b.dtype for _, b, _ in opt._accumulation.buffered()} == {torch.bfloat16}
    assert opt._accumulation.buffer_bytes() == 2 * params  # one bf16 buffer per parameter
    opt32 = Lomo(tiny_llama(torch.bfloat16), lr=0.05, accumulation_steps=K,
                 accumulation_dtype=torch.float32)  # fmt: skip
    opt32.fused_backward(opt32.model(**micro_batches(0)[0]).loss)
    assert {b.dtype for _, b, _ in opt32._accumulation.buffered()} == {torch.float32}
    assert opt32._accumulation.buffer_bytes() == 4 * params


def test_bf16_buffer_holds_gradients_past_fp16_range():
    # A bf16 buffer has fp32's range: micro-batch gradients of 2**17 (past fp16's 65504) are
    # summed and applied, not flagged as an overflow (an fp16 buffer would store inf and skip
    # the step). 2**17, the sum 2**18 and lr * 2**18 = 2**-2 are exact in bf16: the weight
    # is exactly -0.25 after the step, whatever the rounding.
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(torch.zeros(64, dtype=torch.bfloat16))
    opt = Lomo(module, lr=2.0**-20, accumulation_steps=2)
    for _ in range(2):
        opt.fused_backward(module.weight.float().sum() * 2.0**17)
    opt.flush_report()
    assert opt.step_count == 1 and not opt.last_step_skipped
    assert torch.equal(module.weight, torch.full((64,), -0.25, dtype=torch.bfloat16))


def test_refusals_before_any_change(tmp_path):
    import lomo_kernels

    model = tiny_llama()
    opt = Lomo(model, lr=0.05, clip_grad_norm=1.0, accumulation_steps=K)
    lomo_kernels.save_checkpoint(tmp_path / "saved", model, opt)
    opt.fused_backward(model(**micro_batches(0)[0]).loss / K)
    loss = model(**micro_batches(0)[1]).loss / K
    assert_refused(model, opt, lambda: opt.grad_norm(loss), RuntimeError, "accumulation_steps")
    waiting = r"1 micro-batch accumulated and not applied \(a step is 4\)"
    assert_refused(model, opt, opt.state_dict, RuntimeError, waiting)
    assert_refused(model, opt, opt.consolidated_state_dict, RuntimeError, waiting)
    assert_refused(model, opt, lambda: opt.load_state_dict({}), RuntimeError, waiting)
    # check_state_dict raises what load_state_dict would, even for a checkpoint it would take.
    saved = Lomo(tiny_llama(), lr=0.05, clip_grad_norm=1.0, accumulation_steps=K).state_dict()
    check = lambda: opt.check_state_dict(saved)  # noqa: E731
    assert_refused(model, opt, check, RuntimeError, rf"load_state_dict\(\) with {waiting}")
    own = lambda: opt.refuse_pending_micro_batches("my_save()")  # noqa: E731
    assert_refused(model, opt, own, RuntimeError, rf"my_save\(\) with {waiting}")
    # Sharded checkpoints mid-step: a save refused before anything is written, a load before
    # anything is read into the model or the optimizer.
    save = lambda: lomo_kernels.save_checkpoint(tmp_path / "ckpt", model, opt)  # noqa: E731
    assert_refused(model, opt, save, RuntimeError, waiting)
    assert not (tmp_path / "ckpt").exists()
    load = lambda: lomo_kernels.load_checkpoint(tmp_path / "saved", model, opt)  # noqa: E731
    assert_refused(model, opt, load, RuntimeError, rf"load_checkpoint\(\) with {waiting}")
    # Named as a load before any file is read: a missing checkpoint is not reached.
    missing = lambda: lomo_kernels.load_checkpoint(tmp_path / "none", model, opt)  # noqa: E731
    assert_refused(model, opt, missing, RuntimeError, rf"load_checkpoint\(\) with {waiting}")
    # A sparse gradient (here torch.gather's, which no module flag shows): seen in the loss's
    # graph, before the backward adds anything into the buffers.
    embed = model.model.embed_tokens
    embed.forward = lambda ids: torch.gather(
        embed.weight, 0, ids.reshape(-1, 1).expand(-1, embed.weight.shape[1]), sparse_grad=True
    ).reshape(*ids.shape, -1)
    sparse = model(**micro_batches(0)[1]).loss / K
    assert_refused(model, opt, lambda: opt.fused_backward(sparse), ValueError, "sparse_grad")
    assert opt.pending_micro_batches == 1


def test_a_load_in_a_loop_that_ends_the_steps_is_refused_as_a_load(tmp_path):
    """In a loop that decides where steps end (a Trainer's), a save mid-step leaves the
    pending micro-batches out with a warning; a load is refused all the same, as a load,
    before any file is read, and without that save-time warning."""
    import lomo_kernels

    model = tiny_llama()
    opt = Lomo(model, lr=0.05, accumulation_steps=K)
    lomo_kernels.save_checkpoint(tmp_path / "saved", model, opt)
    opt._fused_backward_in_loop(model(**micro_batches(0)[0]).loss / K, None, loop_syncs=False)
    load = lambda: lomo_kernels.load_checkpoint(tmp_path / "saved", model, opt)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_refused(model, opt, load, RuntimeError, r"load_checkpoint\(\) with 1 micro-batch")
    assert opt.pending_micro_batches == 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"accumulation_steps": 0}, "accumulation_steps must be an int >= 1"),
        ({"accumulation_steps": 2.0}, "accumulation_steps must be an int >= 1"),
        ({"accumulation_steps": True}, "accumulation_steps must be an int >= 1"),  # an int
        ({"accumulation_steps": 2, "accumulation_dtype": torch.int16}, "accumulation_dtype"),
        ({"accumulation_dtype": torch.float32}, "leave it out"),
        ({"accumulation_steps": 2, "single_backward": True}, "single_backward"),
    ],
)
def test_bad_accumulation_arguments_are_refused(kwargs, match):
    model = tiny_llama()
    with pytest.raises(ValueError, match=match):
        Lomo(model, lr=0.05, **kwargs)
    Lomo(model, lr=0.05).detach()  # no hook was left behind


def test_a_failed_micro_batch_drops_the_step_and_changes_nothing():
    model = tiny_llama()
    opt = Lomo(model, lr=0.05, accumulation_steps=K)
    start = snapshot(model)
    opt.fused_backward(model(**micro_batches(0)[0]).loss / K)
    error = fail_in_backward(model, opt)
    assert "dropped" in "".join(getattr(error, "__notes__", []))
    assert unchanged(model, start) and opt.pending_micro_batches == 0 and opt.step_count == 0


def test_a_micro_batch_refused_before_reaching_the_buffers_keeps_the_pending_ones():
    # A loss back-propagated already raises in torch's backward before any gradient reaches
    # a buffer: the micro-batches before it stay pending, and the step they complete equals
    # one that never saw the failed call, bit for bit.
    model, ref = tiny_llama(), tiny_llama()
    opt = Lomo(model, lr=0.05, clip_grad_norm=0.5, accumulation_steps=K)
    ref_opt = Lomo(ref, lr=0.05, clip_grad_norm=0.5, accumulation_steps=K)
    micros = micro_batches(0)
    ref_opt.fused_backward(ref(**micros[0]).loss / K)
    loss = model(**micros[0]).loss / K
    opt.fused_backward(loss)
    with pytest.raises(RuntimeError, match="second time") as raised:
        opt.fused_backward(loss)
    assert "1 pending kept" in "".join(raised.value.__notes__)
    assert opt.pending_micro_batches == 1
    for micro in micros[1:]:
        opt.fused_backward(model(**micro).loss / K)
        ref_opt.fused_backward(ref(**micro).loss / K)
    assert opt.step_count == ref_opt.step_count == 1
    assert same_bits(tensors(model, opt), tensors(ref, ref_opt))


@pytest.mark.parametrize(
    ("dtype", "options", "report"),
    [
        # A skipped step's warning made an error (warnings.simplefilter("error")).
        (torch.float32, {}, RuntimeWarning),
        # fp16's overflow at the scaler's minimum scale.
        (torch.float16, {"loss_scale_args": {"init_scale": 1.0, "min_scale": 1.0}},
         FloatingPointError),
    ],
)  # fmt: skip
def test_a_step_reported_at_the_next_micro_batch_before_any_change(dtype, options, report):
    # A step's outcome is reported at the next call, before that call changes anything: a
    # report that raises leaves that micro-batch out whole, and the next k micro-batches make
    # exactly the step a fresh optimizer makes from them, bit for bit (not k + 1 micro-batches
    # piled into one). Rounded to nearest: the fresh optimizer's step count differs.
    ours, fresh = tiny_llama(dtype), tiny_llama(dtype)
    opt = Lomo(ours, lr=0.05, accumulation_steps=K, stochastic_rounding=False, **options)
    fresh_opt = Lomo(fresh, lr=0.05, accumulation_steps=K, stochastic_rounding=False, **options)
    skipped, micros = micro_batches(0), micro_batches(1)
    for i, micro in enumerate(skipped):
        loss = ours(**micro).loss / K
        opt.fused_backward(loss * float("inf") if i == 0 else loss)
    start = snapshot(ours)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with pytest.raises(report):
            opt.fused_backward(ours(**micros[0]).loss / K)
    assert same_bits(start, snapshot(ours))
    assert opt.step_count == 1 and opt.pending_micro_batches == 0
    assert opt.last_step_skipped
    for i, micro in enumerate(micros):
        assert opt.pending_micro_batches == i
        opt.fused_backward(ours(**micro).loss / K)
        fresh_opt.fused_backward(fresh(**micro).loss / K)
    assert opt.step_count == 2 and opt.pending_micro_batches == 0
    assert same_bits(snapshot(ours), snapshot(fresh))
    assert not same_bits(start, snapshot(ours))


@pytest.mark.parametrize("optimizer", [Lomo, AdaLomo])
def test_a_loss_scale_set_while_micro_batches_wait_is_refused(optimizer):
    # The buffers hold gradients scaled by the step's first micro-batch's scale, which the
    # step divides by the scale then set: a new scale between micro-batches is refused (at
    # the next micro-batch and at step()), a scale set back or between steps is taken.
    model = tiny_llama(torch.float16)
    opt = optimizer(model, lr=0.05, accumulation_steps=K)
    name = "loss_scaler.cur_scale" if optimizer is Lomo else "loss_scale"
    owner = opt.loss_scaler if optimizer is Lomo else opt
    attribute = name.rsplit(".", 1)[-1]
    scale = getattr(owner, attribute)
    micros = micro_batches(0)
    opt.fused_backward(model(**micros[0]).loss / K)
    setattr(owner, attribute, scale / 4)
    loss = model(**micros[1]).loss / K
    message = rf"{name} was set with 1 micro-batch accumulated and not applied \(a step is {K}\)"
    assert_refused(model, opt, lambda: opt.fused_backward(loss), RuntimeError, message)
    assert_refused(model, opt, opt.step, RuntimeError, message)
    setattr(owner, attribute, scale)
    for micro in micros[1:]:
        opt.fused_backward(model(**micro).loss / K)
    assert opt.step_count == 1 and opt.pending_micro_batches == 0
    setattr(owner, attribute, scale / 4)  # between steps: the next step's scale
    opt.fused_backward(model(**micros[0]).loss / K)
    assert opt.pending_micro_batches == 1


def fail_in_backward(model, opt) -> BaseException:
    """A micro-batch whose backward raises (a tensor hook of the embedding's): the error."""

    def fail(grad):
        raise RuntimeError("planted")

    handle = model.model.embed_tokens.weight.register_hook(fail)
    with pytest.raises(RuntimeError, match="planted") as info:
        opt.fused_backward(model(**micro_batches(0)[1]).loss / K)
    handle.remove()
    return info.value


@pytest.mark.parametrize(
    "drop",
    [
        lambda model, opt: opt.zero_grad(),
        lambda model, opt: opt.zero_grad(set_to_none=False),  # the buffers kept
        fail_in_backward,
    ],
    ids=["zero_grad", "zero_grad-keep-buffers", "failed-micro-batch"],
)
def test_dropped_micro_batches_leave_nothing_in_the_next_step(drop):
    # The next k micro-batches make the step a fresh optimizer makes from them, bit for bit:
    # nothing of the dropped ones is applied or measured.
    model, fresh = tiny_llama(), tiny_llama()
    opt = Lomo(model, lr=0.05, clip_grad_norm=0.3, accumulation_steps=K)
    fresh_opt = Lomo(fresh, lr=0.05, clip_grad_norm=0.3, accumulation_steps=K)
    opt.fused_backward(model(**micro_batches(0)[0]).loss / K)
    drop(model, opt)
    assert opt.pending_micro_batches == 0
    for micro in micro_batches(1):
        opt.fused_backward(model(**micro).loss / K)
        fresh_opt.fused_backward(fresh(**micro).loss / K)
    assert opt.step_count == fresh_opt.step_count == 1
    assert same_bits(snapshot(model), snapshot(fresh))
    assert torch.equal(opt.last_grad_norm, fresh_opt.last_grad_norm)


def test_buffers_stay_from_step_to_step_until_zero_grad_or_detach_frees_them(monkeypatch):
    # One buffer per parameter, allocated at the first step and reused by every later one
    # (its first gradient overwrites it: no clearing pass); zero_grad(set_to_none=False)
    # keeps them, as torch's keeps .grad; zero_grad() and detach() free them.
    calls = record_lomo_calls(monkeypatch)
    model = tiny_llama()
    opt = Lomo(model, lr=0.05, accumulation_steps=K)
    nbytes = 4 * sum(p.numel() for p in model.parameters())

    def buffers() -> dict[int, torch.Tensor]:
        return {id(p): b for p, b, _ in opt._accumulation.buffered()}

    def same_tensors(a: dict[int, torch.Tensor], b: dict[int, torch.Tensor]) -> bool:
        return a.keys() == b.keys() and all(a[key] is b[key] for key in a)

    opt.fused_backward(model(**micro_batches(0)[0]).loss / K)
    first = buffers()  # held here: freed buffers could not come back as these objects
    assert len(first) == len(list(model.parameters()))
    for micro in micro_batches(0)[1:]:
        opt.fused_backward(model(**micro).loss / K)
    assert opt.step_count == 1 and opt._accumulation.buffer_bytes() == nbytes
    calls.clear()
    opt.fused_backward(model(**micro_batches(1)[0]).loss / K)
    assert same_tensors(buffers(), first)  # the next step's buffers are the same tensors
    # Each written by one accumulate pass that overwrites it (`first`), none zeroed before.
    firsts = [args["first"] for op, args in calls if op == "grad_accumulate_"]
    assert firsts == [True] * len(first)
    opt.zero_grad(set_to_none=False)
    assert opt.pending_micro_batches == 0 and opt._accumulation.buffer_bytes() == nbytes
    opt.fused_backward(model(**micro_batches(1)[0]).loss / K)
    assert same_tensors(buffers(), first)
    opt.zero_grad()
    assert opt.pending_micro_batches == 0 and opt._accumulation.buffer_bytes() == 0
    opt.fused_backward(model(**micro_batches(1)[0]).loss / K)
    assert opt._accumulation.buffer_bytes() == nbytes
    with pytest.warns(RuntimeWarning, match="dropped 1 micro-batch"):
        opt.detach()
    assert opt._accumulation.buffer_bytes() == 0


def test_model_zero_grad_leaves_the_micro_batches():
    # The micro-batches live in the buffers, not in .grad: model.zero_grad() between them
    # changes nothing, and the step equals one without the call, bit for bit.
    model, ref = tiny_llama(), tiny_llama()
    opt = Lomo(model, lr=0.05, clip_grad_norm=0.5, accumulation_steps=K)
    ref_opt = Lomo(ref, lr=0.05, clip_grad_norm=0.5, accumulation_steps=K)
    for i, micro in enumerate(micro_batches(0)):
        opt.fused_backward(model(**micro).loss / K)
        ref_opt.fused_backward(ref(**micro).loss / K)
        if i < K - 1:
            model.zero_grad()
            assert opt.pending_micro_batches == i + 1
    assert opt.step_count == 1 and same_bits(snapshot(model), snapshot(ref))
    assert torch.equal(opt.last_grad_norm, ref_opt.last_grad_norm)


@pytest.mark.parametrize(
    ("gradient", "buffer", "loss_scale", "skipped"),
    [
        (60.0, torch.float16, 2**10, False),  # 60 * 2**10 = 61440 <= 65504
        (80.0, torch.float16, 2**10, True),  # 81920: past the fp16 buffer's range
        (80.0, torch.float32, 2**10, False),
        (80.0, torch.float16, 2**9, False),  # 40960
    ],
)
def test_adalomo_fp16_buffer_holds_the_scaled_sum_below_fp16_overflow(gradient, buffer, loss_scale,
                                                               skipped):  # fmt: skip
    # AdaLomo's static loss_scale multiplies the loss in every dtype (as lomo-optim's), and a
    # buffer holds the scaled sum: an fp16 buffer overflows where the accumulated gradient
    # times the scale passes 65504, and the step is skipped whole with a warning; an fp32
    # buffer, or a lower scale, applies it. Each micro-batch adds gradient / 2 to each element.
    def step(dtype: torch.dtype) -> tuple[torch.nn.Module, AdaLomo]:
        module = torch.nn.Module()
        module.weight = torch.nn.Parameter(torch.ones(4, 4))
        opt = AdaLomo(module, lr=0.01, accumulation_steps=2, accumulation_dtype=dtype,
                      loss_scale=loss_scale)  # fmt: skip
        for _ in range(2):
            opt.fused_backward(module.weight.sum() * (gradient / 2))
        assert opt.step_count == 1
        return module, opt

    module, opt = step(buffer)
    if skipped:
        with pytest.warns(RuntimeWarning, match="skipped whole"):
            opt.flush_report()
        assert opt.last_step_skipped and torch.equal(module.weight, torch.ones(4, 4))
        return
    opt.flush_report()
    assert not opt.last_step_skipped and not torch.equal(module.weight, torch.ones(4, 4))
    # The scaled sums are exact in fp16 here, so the step is the fp32 buffer's bit for bit.
    assert torch.equal(module.weight, step(torch.float32)[0].weight)


@pytest.mark.parametrize("how", ["state_dict", "checkpoint"])
@pytest.mark.parametrize(
    ("optimizer", "dtype"),
    [(Lomo, torch.bfloat16), (AdaLomo, torch.bfloat16), (Lomo, torch.float16)],
    ids=["lomo-bf16", "adalomo-bf16", "lomo-fp16"],
)
def test_a_save_after_a_step_s_last_micro_batch_resumes_bit_for_bit(tmp_path, how, optimizer,
                                                                     dtype):  # fmt: skip
    # Saved between steps (nothing pending), loaded into a new model and optimizer, the next
    # step is the uninterrupted run's, bit for bit: the step count (which keys the stochastic
    # rounding), the moments and the fp16 loss scale resume; the buffers hold nothing then.
    import lomo_kernels

    def build(model):
        return optimizer(model, lr=0.05, clip_grad_norm=0.5, accumulation_steps=K)

    model = tiny_llama(dtype)
    opt = build(model)
    train_accumulating(model, opt, steps=2)
    resumed = tiny_llama(dtype, seed=1)
    if how == "state_dict":
        resumed.load_state_dict(model.state_dict())
        resumed_opt = build(resumed)
        resumed_opt.load_state_dict(opt.state_dict())
    else:
        lomo_kernels.save_checkpoint(tmp_path / "ckpt", model, opt)
        resumed_opt = build(resumed)
        lomo_kernels.load_checkpoint(tmp_path / "ckpt", resumed, resumed_opt)
    for m, o in ((model, opt), (resumed, resumed_opt)):
        for micro in micro_batches(2):
            o.fused_backward(m(**micro).loss / K)
    assert resumed_opt.step_count == opt.step_count == 3
    assert same_bits(tensors(model, opt), tensors(resumed, resumed_opt))


def test_detach_warns_when_it_drops_pending_micro_batches():
    model = tiny_llama()
    start = snapshot(model)
    dropped = pytest.warns(RuntimeWarning, match=r"dropped 1 micro-batch accumulated and not")
    with dropped, Lomo(model, lr=0.05, accumulation_steps=K) as opt:
        opt.fused_backward(model(**micro_batches(0)[0]).loss / K)
    assert unchanged(model, start) and opt.pending_micro_batches == 0
    with warnings.catch_warnings():  # nothing pending: detached quietly
        warnings.simplefilter("error", RuntimeWarning)
        with Lomo(model, lr=0.05, accumulation_steps=K) as opt:
            for micro in micro_batches(0):
                opt.fused_backward(model(**micro).loss / K)


def test_the_last_micro_batch_s_lr_is_the_step_s():
    # lr passed to fused_backward sets the groups' lr at each call; the k-th call's applies.
    ours, ref = tiny_llama(), tiny_llama()
    opt = Lomo(ours, lr=0.05, accumulation_steps=K)
    micros = micro_batches(0)
    for i, micro in enumerate(micros):
        opt.fused_backward(ours(**micro).loss / K, lr=0.2 if i == K - 1 else 0.01)
    sgd = torch.optim.SGD(ref.parameters(), lr=0.2)
    for micro in micros:
        (ref(**micro).loss / K).backward()
    sgd.step()
    assert max_rel_diff(ours, ref) <= FP32_BOUND


def test_fp16_loss_scale_is_one_per_step_and_grows_per_step():
    # One scale for the k micro-batches of a step; a clean step grows it (scale_window=1),
    # counted in steps, not micro-batches.
    model = tiny_llama(torch.float16)
    opt = Lomo(model, lr=0.05, accumulation_steps=K,
               loss_scale_args={"init_scale": 1024.0, "scale_window": 1})  # fmt: skip
    seen = []
    for step in range(3):
        for micro in micro_batches(step):
            seen.append(opt.loss_scaler.loss_scale)
            opt.fused_backward(model(**micro).loss / K)
    assert seen == [1024.0] * K + [2048.0] * K + [4096.0] * K
    assert opt.step_count == 3 and not opt.last_step_skipped


@pytest.mark.parametrize("optimizer", [Lomo, AdaLomo])
def test_logits_free_head_accumulates_from_row_blocks(monkeypatch, optimizer):
    # The patched head hands its weight's gradient over in vocabulary chunks (64 and 32 rows
    # here): each micro-batch adds them into the head's buffer, the head's whole gradient
    # never exists, and the step equals the unpatched model's.
    from lomo_kernels import patch_causal_lm
    from lomo_kernels.ops import cross_entropy as lce

    monkeypatch.setattr(lce, "CHUNK_ELEMENTS", 64 * 32)
    patched, plain = patch_causal_lm(tiny_llama()), tiny_llama()
    materialised: list[int] = []
    original = lce._backward_op
    monkeypatch.setattr(lce, "_backward_op", lambda *a: (materialised.append(1), original(*a))[1])
    lr = 0.05 if optimizer is Lomo else 1e-3
    ours = optimizer(patched, lr=lr, clip_grad_norm=0.5, accumulation_steps=K)
    ref = optimizer(plain, lr=lr, clip_grad_norm=0.5, accumulation_steps=K)
    train_accumulating(patched, ours, steps=2)
    train_accumulating(plain, ref, steps=2)
    assert not materialised
    # The fused loss sums the chunks' fp32 partial results in another order than the
    # materialised logits' cross-entropy: the fp32 bound of the rest of this file.
    assert max_rel_diff(patched, plain) <= FP32_BOUND


@pytest.mark.parametrize("optimizer", [Lomo, AdaLomo])
def test_embedding_rows_the_measuring_micro_batch_does_not_use_are_measured(monkeypatch, optimizer):
    # The patched input embedding hands its gradient over as chunks of the rows a batch used
    # (64 and 32 rows here); a micro-batch skips the chunks it uses no id of. The measuring
    # (last) one must not: its ids here all fall in the first chunk, so the second chunk's
    # rows hold only the earlier micro-batches' gradients, which the step's norm and clip
    # coefficient count as the unpatched model's do.
    from lomo_kernels import patch_causal_lm
    from lomo_kernels.ops import cross_entropy as lce

    monkeypatch.setattr(lce, "CHUNK_ELEMENTS", 64 * 32)
    patched, plain = patch_causal_lm(tiny_llama()), tiny_llama()
    micros = micro_batches(0)
    assert all((micro["input_ids"] >= 64).any() for micro in micros[:-1])
    last = micros[-1]["input_ids"] % 64
    micros[-1] = {"input_ids": last, "labels": last}
    lr = 0.05 if optimizer is Lomo else 1e-3
    opts = [optimizer(m, lr=lr, clip_grad_norm=0.5, accumulation_steps=K) for m in (patched, plain)]
    for model, opt in zip((patched, plain), opts, strict=True):
        for micro in micros:
            opt.fused_backward(model(**micro).loss / K)
    ours, ref = (float(opt.last_grad_norm) for opt in opts)
    assert ref > 0.5  # the clip binds: a norm missing rows would scale the whole step
    # A sum in another order: a few fp32 ulps (FP32_BOUND, relative), as above.
    assert abs(ours / ref - 1) <= FP32_BOUND
    assert max_rel_diff(patched, plain) <= FP32_BOUND


def lookup_in_reentrant_checkpoint(model) -> None:
    """Runs `model`'s input embedding inside torch.utils.checkpoint(use_reentrant=True): the
    lookup's node is then in a graph of its own, which the read of the loss's graph does not
    reach (a reentrant segment needs an input that requires grad: a 1.0 scale)."""
    from torch.utils.checkpoint import checkpoint

    embed = model.model.embed_tokens
    lookup, one = embed.forward, torch.ones((), requires_grad=True)
    embed.forward = lambda ids: checkpoint(lambda i, s: lookup(i) * s, ids, one,
                                           use_reentrant=True)  # fmt: skip


@pytest.mark.parametrize("optimizer", [Lomo, AdaLomo])
@pytest.mark.parametrize("hidden", [False, True], ids=["graph_shows_it", "checkpointed_lookup"])
def test_tied_head_in_row_blocks_is_measured_once(monkeypatch, optimizer, hidden):
    # A head tied to the input embedding gets two gradients per micro-batch, both in row
    # blocks (the fused loss's vocabulary chunks and the embedding's used rows), added into one
    # buffer. The measuring micro-batch must count that buffer once: the step's norm and
    # clip coefficient equal the unpatched tied model's (a buffer summed per contribution
    # would count the head twice and clip the whole step harder). `hidden`: the lookup runs
    # in a reentrant checkpoint, so the loss's graph does not show the second use; the
    # buffer is then measured whole at the step once its rows come a second time.
    from lomo_kernels import patch_causal_lm
    from lomo_kernels.ops import cross_entropy as lce

    monkeypatch.setattr(lce, "CHUNK_ELEMENTS", 64 * 32)
    patched = patch_causal_lm(tiny_llama(tie_word_embeddings=True))
    plain = tiny_llama(tie_word_embeddings=True)
    if hidden:
        lookup_in_reentrant_checkpoint(patched)
        lookup_in_reentrant_checkpoint(plain)
    lr = 0.05 if optimizer is Lomo else 1e-3
    ours = optimizer(patched, lr=lr, clip_grad_norm=0.5, accumulation_steps=K)
    ref = optimizer(plain, lr=lr, clip_grad_norm=0.5, accumulation_steps=K)
    train_accumulating(patched, ours, steps=2)
    train_accumulating(plain, ref, steps=2)
    assert max_rel_diff(patched, plain) <= FP32_BOUND
    # The norm is a sum in another order: a few fp32 ulps (FP32_BOUND, relative).
    assert abs(float(ours.last_grad_norm) / float(ref.last_grad_norm) - 1) <= FP32_BOUND


def test_compiled_autograd_is_refused_before_any_change():
    from lomo_kernels.core.torch_internals import enable_compiled_autograd

    model = tiny_llama()
    opt = Lomo(model, lr=0.05, accumulation_steps=K)
    loss = model(**micro_batches(0)[0]).loss / K
    with enable_compiled_autograd(torch.compile(backend="eager")):
        assert_refused(model, opt, lambda: opt.fused_backward(loss), RuntimeError,
                       "compiled autograd")  # fmt: skip
    assert opt.pending_micro_batches == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_slices_accumulate_as_the_whole_buffer(backend, dtype):
    # A rank's shard starts at an arbitrary flat offset (here odd): its buffer draws the
    # bits of its elements' flat indices in one call per micro-batch, so the ranks together
    # store the whole buffer's bits.
    from support.recording import RecordingBackend

    from lomo_kernels.distributed import Shard
    from lomo_kernels.ops.backends import LOMO
    from lomo_kernels.optim.accumulation import Accumulation
    from lomo_kernels.optim.rounding import WriteBackRounding

    gen = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.zeros(4099, dtype=dtype))
    grads = [torch.randn(4099, generator=gen).to(dtype) * 1e-3 for _ in range(3)]
    calls: list[tuple[str, dict]] = []
    module = RecordingBackend(LOMO.resolve(torch.device("cpu"), backend), calls)
    stored = []
    for cuts in ((0, 4099), (0, 1237, 4099)):
        parts = []
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):  # one Accumulation per rank
            accumulation = Accumulation(3, None, WriteBackRounding(True, seed=11))
            accumulation.begin_micro_batch(5, [torch.device("cpu")], measuring=False)
            shard = Shard(param, param.detach()[a:b], a, param.shape, None)
            for grad in grads:
                piece = piece_of(param, grad[a:b], target=shard.local, offset=a, shard=shard)
                accumulation.add(piece, 7, None, module)
            parts += [buffer for _, buffer, _ in accumulation.buffered()]
        stored.append(torch.cat(parts))
    whole, sliced = stored
    assert torch.equal(whole.view(torch.int16), sliced.view(torch.int16))
    assert [args["offset"] for _, args in calls] == [0] * 3 + [0] * 3 + [1237] * 3


@pytest.mark.parametrize("optimizer", [Lomo, AdaLomo])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_no_host_sync_in_micro_batches_or_the_step(optimizer, dtype):
    # Every micro-batch and the step from the buffers (8 micro-batches: 2 steps) on the eager
    # fast path, failing on any host read of a tensor's values.
    from support.host_sync import train_without_host_sync

    lr = 0.05 if optimizer is Lomo else 1e-3
    _, opt = train_without_host_sync(optimizer, dtype, steps=8, lr=lr, clip_grad_norm=1.0,
                                     accumulation_steps=4)  # fmt: skip
    assert opt.step_count == 2


def test_sharded_update_batches_are_whole_parameters_up_to_the_bucket(monkeypatch):
    """The step from sharded buffers hands the update runs of whole parameters whose full
    sizes sum to at most the bucket (one larger than the bucket: a run of its own), in the
    order the gradients came, which every rank shares; None: one run of all."""
    from types import SimpleNamespace

    from lomo_kernels.optim.accumulation import Accumulation
    from lomo_kernels.optim.rounding import WriteBackRounding

    accumulation = Accumulation(K, None, WriteBackRounding(True, 0))
    sizes = [8, 3, 4, 2, 9, 1, 1, 5]
    entries = [(i, None, SimpleNamespace(full_numel=n)) for i, n in enumerate(sizes)]
    monkeypatch.setattr(accumulation, "buffered", lambda: entries)
    runs = [[shard.full_numel for _, _, shard in run] for run in accumulation.batches(7)]
    assert runs == [[8], [3, 4], [2], [9], [1, 1, 5]]
    assert [[i for i, _, _ in run] for run in accumulation.batches(None)] == [list(range(8))]


@pytest.mark.parametrize("setup", ["whole", "int8", "parts", "row-blocks", "int8-row-blocks"])
def test_the_last_micro_batch_measures_as_it_adds(monkeypatch, setup):
    # The norm the step clips by is measured by the last micro-batch's pass as it adds each
    # gradient into its buffer (no norm pass): the step reads no buffer again to measure it,
    # whether the gradients come whole (into the parameter's dtype or 8-bit buffers), in
    # parts (reentrant checkpoint segments: the second part measures the buffer anew) or in
    # row blocks (the logits-free head and embedding; chunks of 64 and 32 rows of 32, whole
    # 8-bit blocks of 256). A step applied early by step()
    # measures every buffer there instead (its micro-batches did not measure), which shows
    # the count sees those reads.
    from lomo_kernels import patch_causal_lm
    from lomo_kernels.ops import cross_entropy as lce
    from lomo_kernels.optim import int8_buffer
    from lomo_kernels.optim.device_scalars import DeviceScalars

    reads = []

    def counted(read):
        def wrapper(*args, **kwargs):
            reads.append(read.__name__)
            return read(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(DeviceScalars, "measure", counted(DeviceScalars.measure))
    monkeypatch.setattr(int8_buffer, "measure_sumsq", counted(int8_buffer.measure_sumsq))
    monkeypatch.setattr(lce, "CHUNK_ELEMENTS", 64 * 32)  # the head's rows in two blocks
    if setup == "parts":
        model = LayerInTwoSegments(reentrant=True)
        gen = torch.Generator().manual_seed(0)
        losses = [lambda: model(torch.randn(5, 6, generator=gen).requires_grad_()) / K] * K
    else:
        model = patch_causal_lm(tiny_llama()) if "row-blocks" in setup else tiny_llama()
        losses = [lambda m=m: model(**m).loss / K for m in micro_batches(0)]
    dtype = torch.int8 if "int8" in setup else None
    opt = Lomo(model, lr=0.05, clip_grad_norm=0.5, accumulation_steps=K, accumulation_dtype=dtype)
    for loss in losses:
        opt.fused_backward(loss())
    assert opt.step_count == 1 and reads == []
    for loss in losses[:-1]:
        opt.fused_backward(loss())
    opt.step()
    trained = sum(1 for p in model.parameters() if p.requires_grad)
    assert opt.step_count == 2 and len(reads) == trained


def test_each_part_of_a_gradient_draws_the_same_bits_in_every_micro_batch(backend):
    # A gradient that arrives in parts (reentrant checkpoint segments, a tied head's two
    # uses) adds each part into the buffer with bits of its own: the first with the
    # parameter's seed, the j-th with parameter_seed(index, j), counted anew in every
    # micro-batch. The second part comes here in two blocks of rows, which are one part:
    # they round as that part's whole gradient would.
    from lomo_kernels import ops
    from lomo_kernels.ops.backends import LOMO
    from lomo_kernels.optim.accumulation import Accumulation, micro_batch_value
    from lomo_kernels.optim.rounding import WriteBackRounding, parameter_seed

    index, seed, step_count = 5, 13, 2
    gen = torch.Generator().manual_seed(1)
    param = torch.nn.Parameter(torch.zeros(29, 7, dtype=torch.bfloat16))
    parts = [[torch.randn(29, 7, generator=gen) * 1e-3 for _ in range(2)] for _ in range(3)]
    cpu = torch.device("cpu")
    module = LOMO.resolve(cpu, backend)
    accumulation = Accumulation(4, None, WriteBackRounding(True, seed=seed))
    expected = torch.empty_like(param)
    for micro_batch, grads in enumerate(parts):
        accumulation.begin_micro_batch(step_count, [cpu], measuring=False)
        seed_step = torch.tensor([micro_batch_value(seed, step_count, micro_batch)])
        for part, grad in enumerate(grads):
            for a, b in ((0, 29),) if part == 0 else ((0, 16), (16, 29)):
                rows = piece_of(param, grad[a:b], target=param.detach()[a:b], offset=a * 7)
                accumulation.add(rows, index, None, module)
            ops.grad_accumulate_(expected, grad, first=micro_batch == part == 0,
                                 stochastic_rounding=True, seed=parameter_seed(index, part),
                                 seed_step=seed_step, backend=backend)  # fmt: skip
        accumulation.pending += 1
    [(_, buffer, _)] = accumulation.buffered()
    assert same_bits([buffer], [expected])


@pytest.mark.parametrize("dtype", [None, torch.int8], ids=["param-dtype", "int8"])
def test_a_kept_buffer_first_written_in_part_holds_nothing_of_the_last_step(backend, dtype):
    # The buffers stay from step to step; a step whose first gradient covers only some rows
    # of a buffer (the head's row blocks) adds into it zeroed: the rows it does not write
    # read zero, not the last step's sum, and the rows it writes hold its gradient alone.
    from support.int8_model import dequantised

    from lomo_kernels.ops.backends import LOMO
    from lomo_kernels.optim.accumulation import Accumulation
    from lomo_kernels.optim.rounding import WriteBackRounding

    cpu = torch.device("cpu")
    module = LOMO.resolve(cpu, backend)
    param = torch.nn.Parameter(torch.zeros(24, 32))
    gen = torch.Generator().manual_seed(2)
    grads = [torch.randn(24, 32, generator=gen) for _ in range(2)]

    def added(accumulation, step, rows):
        """The buffer's values (float64) after the step's first add, of the first `rows`."""
        accumulation.begin_micro_batch(step, [cpu], measuring=False)
        piece = piece_of(param, grads[step][:rows], target=param.detach()[:rows], offset=0)
        accumulation.add(piece, 0, None, module)
        [(_, buffer, _)] = accumulation.buffered()
        if dtype is None:
            return buffer.double().reshape(-1)
        return dequantised(buffer.codes, buffer.scales, buffer.offset)

    kept = Accumulation(K, dtype, WriteBackRounding(False, 0))
    added(kept, 0, 24)  # the whole weight
    kept.release()  # the step applied; the buffers kept
    later = added(kept, 1, 8).view(24, 32)  # its first 8 rows only
    assert torch.equal(later[8:], torch.zeros(16, 32, dtype=torch.float64))
    # 8 rows of 32 are whole 8-bit blocks: they store what a fresh buffer's add of the whole
    # gradient stores in them.
    fresh = added(Accumulation(K, dtype, WriteBackRounding(False, 0)), 1, 24).view(24, 32)
    assert torch.equal(later[:8], fresh[:8])


def test_every_micro_batch_of_every_step_draws_its_own_bits():
    # The accumulation's per-micro-batch value keys its stochastic rounding: two micro-batches
    # (of one step, or of two steps or seeds) with the same value would round their adds
    # with the same bits, element by element; it is 31 bits, as the write-back's step value
    # (so the kernels' 63-bit seed holds it), and differs from that value of the same step.
    from lomo_kernels.optim.accumulation import micro_batch_value
    from lomo_kernels.optim.rounding import step_value

    seeds, steps, micro_batches = (0, 1, 7, 2**40 + 3), range(8), range(33)
    values = {
        (seed, step, m): micro_batch_value(seed, step, m)
        for seed in seeds
        for step in steps
        for m in micro_batches
    }
    assert len(set(values.values())) == len(values)
    assert all(0 <= v < 2**31 for v in values.values())
    write_back = {step_value(seed, step) for seed in seeds for step in steps}
    assert not write_back & set(values.values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_row_blocks_accumulate_as_the_whole_buffer(backend, dtype):
    # The logits-free head hands a weight's gradient over in blocks of rows, in order: each
    # block adds into the one buffer with the bits of its elements' flat indices, so the
    # blocks store the bits a whole gradient stores, micro-batch after micro-batch. The
    # whole gradient's add is the op's own with the parameter's seed and the micro-batch's
    # value (`micro_batch_value`): the stream the buffer is specified to draw.
    from lomo_kernels import ops
    from lomo_kernels.ops.backends import LOMO
    from lomo_kernels.optim.accumulation import Accumulation, micro_batch_value
    from lomo_kernels.optim.rounding import WriteBackRounding, parameter_seed

    rows, width, index, seed, step_count = 37, 13, 7, 11, 5
    gen = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.zeros(rows, width, dtype=dtype))
    grads = [torch.randn(rows, width, generator=gen).to(dtype) * 1e-3 for _ in range(3)]
    cpu = [torch.device("cpu")]
    module = LOMO.resolve(cpu[0], backend)
    stored = []
    for cuts in ((0, rows), (0, 16, 32, rows)):
        accumulation = Accumulation(4, None, WriteBackRounding(True, seed=seed))
        for grad in grads:
            accumulation.begin_micro_batch(step_count, cpu, measuring=False)
            for a, b in zip(cuts[:-1], cuts[1:], strict=True):
                piece = piece_of(param, grad[a:b], target=param.detach()[a:b], offset=a * width)
                accumulation.add(piece, index, None, module)
            accumulation.pending += 1
        stored += [buffer for _, buffer, _ in accumulation.buffered()]
    expected = torch.empty_like(param)
    for micro_batch, grad in enumerate(grads):
        seed_step = torch.tensor([micro_batch_value(seed, step_count, micro_batch)])
        ops.grad_accumulate_(expected, grad, first=micro_batch == 0, stochastic_rounding=True,
                             seed=parameter_seed(index), seed_step=seed_step,
                             backend=backend)  # fmt: skip
    whole, blocks = stored
    assert same_bits([whole, blocks], [expected, expected])
