"""Fused linear + cross-entropy against the float64 specification and the unfused torch path.

Error model (u = 2**-24, fp32 accumulation; inputs are exact in fp32): a logit is a dot
product over the hidden width H divided by the temperature T, so it is off by at most
(H+1)*u*A[t,v] with A = |h| @ |W|.T / T; the
log-sum-exp adds at most (V+8)*u*max(1, |lse|) (V terms summed, exp/log rounding), so every
probability p is off by at most p*eps[t], eps[t] = 2*H*u*max_v A[t,v] + (V+8)*u*max(1,|lse|).
A gradient is a sum over V (d_hidden) or N (the weight) of products with the logit gradient
DL = g*(p - onehot)/T: its error is at most |g|*eps*(P @ |W|) + (V+H)*u*(|DL| @ |W|) (and
alike for the weight), plus half an ulp of the output dtype. The tests assert these bounds
elementwise; they are first-order and loose by orders of magnitude on random data, but a
wrong block boundary, a missed tile or a stale log-sum-exp exceeds them at once.
"""

from __future__ import annotations

import pytest
import torch
from support.float64 import U32, ulp

from lomo_kernels.ops import cross_entropy as lce
from lomo_kernels.ops.cross_entropy import blocked_backend as blocked
from lomo_kernels.ops.cross_entropy import reference as ref

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
IGNORE = -100


def _triton():
    from lomo_kernels.kernels.triton import runtime
    from lomo_kernels.ops.cross_entropy import triton_backend as triton_lce

    if not runtime.interpret_mode():
        pytest.skip("the Triton kernels run on CPU tensors only under TRITON_INTERPRET=1")
    return triton_lce


@pytest.fixture(params=["blocked", "triton"])
def kernels(request, monkeypatch):
    if request.param == "triton":
        return _triton()
    # Small blocks so that every size below crosses several token and vocabulary blocks.
    monkeypatch.setattr(blocked, "BLOCK_TOKENS", 16)
    monkeypatch.setattr(blocked, "BLOCK_VOCAB", 96)
    return blocked


def _problem(tokens: int, width: int, vocab: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, width, generator=gen).to(dtype)
    weight = (torch.randn(vocab, width, generator=gen) / width**0.5 * 3).to(dtype)
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    labels[::5] = IGNORE
    grad = torch.rand(tokens, generator=gen, dtype=torch.float64) + 0.5
    return hidden, weight, labels, grad


def _error_scales(hidden, weight, labels, grad, temperature=1.0):
    """eps[t] (relative error of each probability) and the float64 magnitudes of the model."""
    h, w = hidden.double(), weight.double()
    vocab, width = weight.shape
    mag = h.abs() @ w.abs().T / temperature
    _, lse = ref.forward(hidden, weight, labels, IGNORE, temperature)
    eps = 2 * (width + 1) * U32 * mag.amax(dim=1) + (vocab + 8) * U32 * lse.abs().clamp_min(1.0)
    probs = torch.softmax(h @ w.T / temperature, dim=1)
    counted = torch.where(labels != IGNORE, grad, 0.0) / temperature
    dl = probs.clone()
    rows = torch.nonzero(labels != IGNORE).squeeze(1)
    dl[rows, labels[rows]] -= 1.0
    dl = (dl * counted[:, None]).abs()
    weighted_p = probs * (counted * eps)[:, None]
    return eps, mag, weighted_p, dl


def _assert_bounded(out, ref64, bound, dtype, what):
    # Rounding to the output dtype: half an ulp at the largest magnitude the result can have.
    bound = bound + 0.5 * ulp(ref64.abs() + bound, dtype)
    err = (out.double() - ref64).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"{what}: error {worst:.3g}x its bound"


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.9])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 40, 333), (1, 24, 50), (70, 16, 200)])
def test_forward_and_backward_match_float64(kernels, dtype, shape, temperature, monkeypatch):
    """Against the float64 specification, and its lse and loss against torch's float64
    log_softmax of the logits over the temperature (an independent formula)."""
    tokens, width, vocab = shape
    hidden, weight, labels, grad = _problem(tokens, width, vocab, dtype)
    monkeypatch.setattr(lce, "CHUNK_ELEMENTS", 100 * width)  # several vocabulary chunks
    loss, lse = kernels.forward(hidden, weight, labels, IGNORE, temperature)
    loss64, lse64 = ref.forward(hidden, weight, labels, IGNORE, temperature)
    log_probs = torch.log_softmax(hidden.double() @ weight.double().T / temperature, dim=1)
    counted = labels != IGNORE
    picked = log_probs.gather(1, torch.where(counted, labels, 0)[:, None]).squeeze(1)
    torch.testing.assert_close(loss64, torch.where(counted, -picked, 0.0), rtol=1e-12, atol=1e-12)
    eps, mag, weighted_p, dl = _error_scales(hidden, weight, labels, grad, temperature)
    _assert_bounded(lse, lse64, eps, torch.float32, "lse")
    _assert_bounded(loss, loss64, eps, torch.float32, "loss")
    assert bool((loss[labels == IGNORE] == 0).all())

    d_weight = torch.full(weight.shape, float("nan"), dtype=torch.float32)

    def sink(start: int, stop: int, chunk: torch.Tensor) -> None:
        d_weight[start:stop] = chunk

    args = (grad.float(), hidden, weight, labels, lse, IGNORE, temperature)
    d_hidden = lce.backward_by_chunks(args, sink, kernels=kernels)
    dh64, dw64 = ref.backward(grad, hidden, weight, labels, IGNORE, temperature)
    w_abs, h_abs = weight.double().abs(), hidden.double().abs()
    dh_bound = weighted_p @ w_abs + (vocab + width) * U32 * (dl @ w_abs)
    dw_bound = weighted_p.T @ h_abs + (tokens + width) * U32 * (dl.T @ h_abs)
    assert d_hidden.dtype == dtype
    _assert_bounded(d_hidden, dh64, dh_bound, dtype, "d_hidden")
    _assert_bounded(d_weight, dw64, dw_bound, torch.float32, "d_weight")


def test_all_ignored_rows_give_zero_loss_and_gradients(kernels):
    hidden, weight, labels, grad = _problem(20, 16, 70, torch.float32)
    labels[:] = IGNORE
    loss, lse = kernels.forward(hidden, weight, labels, IGNORE, 1.0)
    assert bool((loss == 0).all()) and bool(torch.isfinite(lse).all())
    chunks = []
    args = (grad.float(), hidden, weight, labels, lse, IGNORE, 1.0)
    d_hidden = lce.backward_by_chunks(
        args, lambda a, b, c: chunks.append(c.clone()), kernels=kernels
    )
    assert bool((d_hidden == 0).all()) and all(bool((c == 0).all()) for c in chunks)


def test_skipped_outputs_leave_the_others_bit_identical(kernels, monkeypatch):
    """No sink: the weight gradient's products are skipped, d_hidden is unchanged bit for
    bit; no d_hidden: the chunks' weight gradients are unchanged bit for bit (on CPU, where
    both kernels add in a fixed order)."""
    hidden, weight, labels, grad = _problem(20, 16, 150, torch.float32)
    monkeypatch.setattr(lce, "CHUNK_ELEMENTS", 32 * 16)  # 150 rows: 4 x 32 + 22
    _, lse = kernels.forward(hidden, weight, labels, IGNORE, 0.7)
    args = (grad.float(), hidden, weight, labels, lse, IGNORE, 0.7)
    chunks, alone = [], []
    both = lce.backward_by_chunks(args, lambda a, b, c: chunks.append(c.clone()), kernels)
    only_hidden = lce.backward_by_chunks(args, None, kernels)
    none = lce.backward_by_chunks(
        args, lambda a, b, c: alone.append(c.clone()), kernels, with_d_hidden=False
    )
    assert none is None and len(alone) == len(chunks) == 5
    assert torch.equal(only_hidden, both)
    assert all(torch.equal(a, b) for a, b in zip(alone, chunks, strict=True))


@pytest.mark.gpu_smoke
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_public_function_matches_unfused_cross_entropy(reduction, test_device, monkeypatch):
    """fp32, through autograd, on the test device (its kernels: Triton on CUDA): the fused
    loss and both gradients against F.cross_entropy on the materialised logits (each off the
    float64 value by the bounds above; compared here with a bound of 64 u of each result's
    largest magnitude, far above the measured ~2 u). Vocabulary chunks of 64 rows: the
    weight's gradient is put together from several (4 x 64 + 45)."""
    monkeypatch.setattr(lce, "CHUNK_ELEMENTS", 64 * 24)
    hidden, weight, labels, _ = _problem(3 * 11, 24, 301, torch.float32, seed=1)
    hidden = hidden.view(3, 11, 24).to(test_device)
    weight = weight.to(test_device)
    labels = labels.view(3, 11).to(test_device)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    fused = lce.linear_cross_entropy(h1, w1, labels, reduction=reduction)
    unfused = torch.nn.functional.cross_entropy(
        (h2 @ w2.T).view(-1, 301), labels.view(-1), reduction=reduction
    ).view(fused.shape)
    torch.testing.assert_close(fused, unfused, rtol=0, atol=64 * U32 * unfused.abs().max().item())
    weights = torch.rand(fused.shape, generator=torch.Generator().manual_seed(2))
    (fused * weights.to(test_device)).sum().backward()
    (unfused * weights.to(test_device)).sum().backward()
    for a, b in ((h1.grad, h2.grad), (w1.grad, w2.grad)):
        torch.testing.assert_close(a, b, rtol=0, atol=64 * U32 * b.abs().max().item())


def test_num_items_in_batch_divides_the_sum():
    hidden, weight, labels, _ = _problem(17, 16, 90, torch.float32)
    total = lce.linear_cross_entropy(hidden, weight, labels, reduction="sum")
    for items in (7, torch.tensor(7)):
        got = lce.linear_cross_entropy(hidden, weight, labels, num_items_in_batch=items)
        assert got.item() == (total / 7).item()


def test_bad_input_is_refused_with_its_name():
    hidden, weight, labels, _ = _problem(5, 8, 20, torch.float32)
    with pytest.raises(ValueError, match="width 8 do not match a head of width 9"):
        lce.linear_cross_entropy(hidden, torch.zeros(20, 9), labels)
    with pytest.raises(TypeError, match="share one of"):
        lce.linear_cross_entropy(hidden, weight.double(), labels)
    with pytest.raises(TypeError, match="labels must be int64"):
        lce.linear_cross_entropy(hidden, weight, labels.float())
    with pytest.raises(IndexError, match="label 20 is outside the vocabulary"):
        lce.linear_cross_entropy(hidden, weight, torch.full((5,), 20))
    with pytest.raises(ValueError, match="reduction"):
        lce.linear_cross_entropy(hidden, weight, labels, reduction="avg")
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="temperature must be"):
            lce.linear_cross_entropy(hidden, weight, labels, temperature=bad)


@pytest.mark.parametrize("temperature", [0.7, 2.5])
def test_temperature_through_autograd_matches_float64_log_softmax(temperature, monkeypatch):
    """The public function at a temperature, through autograd: per-token loss and both
    gradients against torch's float64 log_softmax of the logits over the temperature
    (64 u of each result's largest magnitude, as the unfused comparison below), the weight's
    gradient from several vocabulary chunks of 64 rows."""
    monkeypatch.setattr(lce, "CHUNK_ELEMENTS", 64 * 24)
    hidden, weight, labels, grad = _problem(29, 24, 301, torch.float32, seed=3)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    fused = lce.linear_cross_entropy(h, w, labels, reduction="none", temperature=temperature)
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    logp = torch.log_softmax(h64 @ w64.T / temperature, dim=1)
    counted = labels != IGNORE
    ref_loss = torch.where(counted, -logp.gather(1, labels.clamp(min=0)[:, None]).squeeze(1), 0.0)
    torch.testing.assert_close(
        fused.double(), ref_loss.detach(), rtol=0, atol=64 * U32 * ref_loss.abs().max().item()
    )
    (fused * grad.float()).sum().backward()
    (ref_loss * grad).sum().backward()
    for a, b in ((h.grad, h64.grad), (w.grad, w64.grad)):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=64 * U32 * b.abs().max().item())


def test_compiles_in_one_graph():
    hidden, weight, labels, _ = _problem(12, 16, 40, torch.float32)
    hidden.requires_grad_()

    def step(h):
        return lce.linear_cross_entropy(h * 2, weight, labels)

    eager = step(hidden)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(hidden)
    assert compiled.item() == eager.item()
