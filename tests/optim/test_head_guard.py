"""A patched model whose logits-free head is bypassed by a wrapper (of any kind) is refused
at the first step, before any parameter or optimizer state changes; what is not a bypass
trains. The per-token outputs (`fused_lm_head=True`) and their statistics against float64."""

from __future__ import annotations

import copy
import functools
import types

import pytest
import torch
import torch.nn.functional as F
from support.models import batch, clone, tiny_llama
from support.optimizers import OPTIMIZERS
from support.state import assert_step_moves, assert_unchanged_since, optimizer_snapshot

import lomo_kernels
from lomo_kernels import Lomo
from lomo_kernels.integrations import token_metrics as metrics

MODES = {
    "plain": {},
    "clip_norm": {"clip_grad_norm": 1.0},
    "single_backward": {"clip_grad_norm": 1.0, "single_backward": True},
}


def own_loss(model, data):
    """The loss of the class's own forward (a wrapper that captured it before patching)."""
    return type(model).forward(model, **data).loss


def chunked_head_loss(model, data):
    """A wrapper that runs the backbone and forms the logits from the head's weight itself,
    as TRL's chunked head does."""
    hidden = model.model(input_ids=data["input_ids"]).last_hidden_state[:, :-1]
    logits = hidden @ model.lm_head.weight.T
    return F.cross_entropy(logits.flatten(0, 1), data["labels"][:, 1:].flatten())


def replaced_forward_loss(model, data):
    """model.forward replaced by a wrapper around the class's forward."""
    model.forward = types.MethodType(
        functools.wraps(type(model).forward)(lambda self, **kw: type(self).forward(self, **kw)),
        model,
    )
    return model(**data).loss


BYPASSES = {
    "class_forward": own_loss,
    "chunked_head": chunked_head_loss,
    "replaced_forward": replaced_forward_loss,
}


def stepped_model(name, mode, tie=False):
    """A patched tiny LLaMA after one accepted step (so that AdaLomo has state)."""
    model = lomo_kernels.patch_causal_lm(tiny_llama(tie_word_embeddings=tie))
    opt = OPTIMIZERS[name](model, lr=0.05, **MODES[mode])
    opt.fused_backward(model(**batch(0)).loss)
    return model, opt


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bypass", BYPASSES)
def test_a_bypassed_head_is_refused_before_any_change(name, mode, bypass):
    model, opt = stepped_model(name, mode)
    before = optimizer_snapshot(model, opt)
    with pytest.raises(RuntimeError, match="'lm_head.weight'.*not through the fused loss"):
        opt.fused_backward(BYPASSES[bypass](model, batch(1)))
    assert_unchanged_since(before, model, opt)
    assert opt.step_count == 1


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_copy_of_a_patched_model_is_guarded_too(name):
    """A deep copy keeps the patch (its forward and mark) but is registered only once its
    patched forward runs: the optimizer built on it guards its head from the first step,
    here a bypassed one."""
    model = copy.deepcopy(lomo_kernels.patch_causal_lm(tiny_llama()))
    opt = OPTIMIZERS[name](model, lr=0.05)
    before = optimizer_snapshot(model, opt)
    with pytest.raises(RuntimeError, match="'lm_head.weight'.*not through the fused loss"):
        opt.fused_backward(own_loss(model, batch(1)))
    assert_unchanged_since(before, model, opt)


def test_only_the_heads_the_optimizer_trains_are_guarded():
    """A loss that also reads another patched model's head the ordinary way (a second model,
    which this optimizer does not train) steps: the guard keeps the memory the patch saves
    for the model being trained, and the other model's head gets its .grad as in torch."""
    model = lomo_kernels.patch_causal_lm(tiny_llama())
    other = lomo_kernels.patch_causal_lm(tiny_llama(seed=1))
    opt = Lomo(model, lr=0.05)
    loss = model(**batch(0)).loss + own_loss(other, batch(0))
    assert_step_moves(model, lambda: opt.fused_backward(loss))
    assert other.lm_head.weight.grad is not None


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_refused_by_grad_norm_too_and_with_tied_weights(name):
    model, opt = stepped_model(name, "clip_norm", tie=True)
    before = optimizer_snapshot(model, opt)
    with pytest.raises(RuntimeError, match="not through the fused loss"):
        opt.grad_norm(chunked_head_loss(model, batch(1)))
    assert_unchanged_since(before, model, opt)


def test_an_optimizer_given_the_parameters_refuses_too():
    model = lomo_kernels.patch_causal_lm(tiny_llama())
    opt = Lomo(model.parameters(), lr=0.05)
    before = optimizer_snapshot(model, opt)
    with pytest.raises(RuntimeError, match="'lm_head.weight'"):
        opt.fused_backward(chunked_head_loss(model, batch(0)))
    assert_unchanged_since(before, model, opt)


def test_logits_asked_for_earlier_do_not_excuse_a_later_bypass():
    """A call without labels marks only the logits it forms as asked for: a bypass after it
    (and after one under torch.no_grad(), as generation runs, whose logits have no node to
    mark) is refused all the same."""
    model = lomo_kernels.patch_causal_lm(tiny_llama())
    data = batch(0)
    assert model(input_ids=data["input_ids"]).logits.grad_fn is not None
    with torch.no_grad():
        assert model(input_ids=data["input_ids"]).logits.grad_fn is None
    opt = Lomo(model, lr=0.05)
    before = optimizer_snapshot(model, opt)
    with pytest.raises(RuntimeError, match="not through the fused loss"):
        opt.fused_backward(own_loss(model, data))
    assert_unchanged_since(before, model, opt)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_what_is_not_a_bypass_trains(name):
    """Logits the patched forward returned for a call without labels (the caller's own
    loss); a wrapper that calls the patched forward under autocast, as accelerate's mixed
    precision does; the head read besides the fused loss (AdaLomo; a Lomo stepping the head
    from chunks refuses that second gradient: test_head_row_blocks); a head that is not
    trained; an unpatched model. Each step updates every trained parameter."""
    model = lomo_kernels.patch_causal_lm(tiny_llama())
    opt = OPTIMIZERS[name](model, lr=0.05, clip_grad_norm=1.0)
    data = batch(0)
    targets = data["labels"][:, 1:].flatten()

    def own_logits_loss():
        logits = model(input_ids=data["input_ids"]).logits
        opt.fused_backward(F.cross_entropy(logits[:, :-1].flatten(0, 1), targets))

    assert_step_moves(model, own_logits_loss)
    patched = model.forward
    model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(patched)
    assert_step_moves(model, lambda: opt.fused_backward(model(**batch(1)).loss))
    model.forward = patched
    if name == "adalomo":  # the whole gradient: a regularizer on the head adds to it
        regularized = model(**batch(1)).loss + model.lm_head.weight.square().sum()
        assert_step_moves(model, lambda: opt.fused_backward(regularized))
    opt.detach()
    model.lm_head.weight.requires_grad_(False)
    frozen_head = OPTIMIZERS[name](model, lr=0.05)
    frozen = ["lm_head.weight"]
    assert_step_moves(model, lambda: frozen_head.fused_backward(own_loss(model, batch(2))), frozen)
    frozen_head.detach()
    plain = tiny_llama()
    plain_opt = OPTIMIZERS[name](plain, lr=0.05)
    assert_step_moves(plain, lambda: plain_opt.fused_backward(chunked_head_loss(plain, batch(3))))


def test_a_patched_copy_is_guarded_and_unpatching_ends_it():
    model = clone(lomo_kernels.patch_causal_lm(tiny_llama()))
    opt = Lomo(model.parameters(), lr=0.05)
    opt.fused_backward(model(**batch(0)).loss)  # the copy's patched forward registers it
    with pytest.raises(RuntimeError, match="'lm_head.weight'"):
        opt.fused_backward(chunked_head_loss(model, batch(1)))
    lomo_kernels.unpatch_causal_lm(model)
    opt.fused_backward(chunked_head_loss(model, batch(1)))


# ---------------------------------------------------------------- fused_lm_head=True outputs


def test_per_token_outputs_match_the_mean_loss_and_need_labels():
    model = lomo_kernels.patch_causal_lm(tiny_llama())
    data = batch(0)
    data["labels"] = data["labels"].clone()
    data["labels"][:, :3] = -100
    out = model(**data, fused_lm_head=True)
    assert out.log_probs.shape == out.entropy.shape == out.is_top1.shape == (2, 11)
    mask = data["labels"][:, 1:] != -100
    assert torch.equal(out.label_mask, mask)
    assert (out.log_probs[~mask] == 0).all() and (out.entropy[~mask] == 0).all()
    torch.testing.assert_close(out.loss, model(**data).loss, rtol=64 * 2.0**-24, atol=0)
    items = torch.tensor(5)
    torch.testing.assert_close(
        model(**data, fused_lm_head=True, num_items_in_batch=items).loss,
        -out.log_probs.sum() / 5,
    )
    shifted = model(input_ids=data["input_ids"], shift_labels=data["labels"], fused_lm_head=True)
    assert shifted.log_probs.shape == (2, 12)
    with pytest.raises(ValueError, match="pass labels"):
        model(input_ids=data["input_ids"], fused_lm_head=True)


def _reference(hidden, weight, labels):
    logits = hidden.double() @ weight.double().T
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    counted = labels != -100
    top1 = (logits.argmax(-1) == labels) & counted
    return torch.where(counted, entropy, 0.0), top1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("blocks", [(4096, 1024), (7, 5)], ids=["one_block", "many_blocks"])
def test_token_metrics_against_float64(monkeypatch, blocks, dtype):
    """Entropy within 1e-5 of float64 and the first argmax (a tie in the data: the earlier
    index wins, as argmax), over one block and over blocks of 7 words x 5 tokens. bf16
    inputs too: on the CPU their logits are formed in fp32, so the same bound holds (logits
    rounded to bf16 would be off by about 1e-3)."""
    monkeypatch.setattr(metrics, "BLOCK_VOCAB", blocks[0])
    monkeypatch.setattr(metrics, "BLOCK_TOKENS", blocks[1])
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 9, 16, generator=gen)
    weight = torch.randn(40, 16, generator=gen)
    weight[31] = weight[3]  # ties at word 3 and 31: argmax is 3
    labels = torch.randint(0, 40, (3, 9), generator=gen)
    labels[0, :2] = -100
    labels[1, 4] = 31
    hidden[1, 4] = weight[3] * 4
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    entropy, top1 = metrics.token_metrics(hidden, weight, labels)
    ref_entropy, ref_top1 = _reference(hidden, weight, labels)
    torch.testing.assert_close(entropy.double(), ref_entropy, rtol=0, atol=1e-5)
    assert torch.equal(top1, ref_top1) and not top1[1, 4]
