"""`patch_causal_lm`: transformers causal LMs whose loss is logits-free, against the same
models unpatched (the unfused head + transformers' own loss)."""

from __future__ import annotations

import pytest
import torch
from support.allocations import LargestMatrix, LargestTensor
from support.models import TINY, assert_steps_match, batch, causal_lm, clone
from support.state import assert_step_moves

import lomo_kernels
from lomo_kernels import AdaLomo, Lomo, patch_causal_lm
from lomo_kernels.integrations.causal_lm import unpatch_causal_lm
from lomo_kernels.ops import cross_entropy as lce
from lomo_kernels.ops.cross_entropy import blocked_backend as blocked

VOCAB = TINY["vocab_size"]


def _model(family: str, tie: bool = False, seed: int = 0, **overrides) -> torch.nn.Module:
    return causal_lm(family, seed=seed, tie_word_embeddings=tie, **overrides)


def _labels_with_ignored(ids: torch.Tensor) -> torch.Tensor:
    labels = ids.clone()
    labels[:, :3] = -100  # a prompt the loss skips
    labels[0, -4:] = -100
    return labels


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_loss_and_gradients_match_unpatched(family):
    """fp32: loss and every gradient within 64 u (u = 2**-24) of the tensor's largest value:
    both sides compute the same fp32 sums in different orders (the fused path's error
    bound, test_linear_cross_entropy, is a few u on these sizes)."""
    plain = _model(family)
    fused = patch_causal_lm(clone(plain))
    data = batch(0, vocab=VOCAB, seq=16)
    data["labels"] = _labels_with_ignored(data["input_ids"])
    out_plain, out_fused = plain(**data), fused(**data)
    assert out_fused.logits is None and out_plain.logits is not None
    scale = 64 * 2.0**-24
    torch.testing.assert_close(out_fused.loss, out_plain.loss, rtol=scale, atol=0)
    out_plain.loss.backward()
    out_fused.loss.backward()
    for (name, a), b in zip(fused.named_parameters(), plain.parameters(), strict=True):
        bound = scale * b.grad.abs().max().item()
        assert (a.grad - b.grad).abs().max().item() <= bound, name


def test_num_items_in_batch_and_no_labels_keep_transformers_meaning():
    plain = _model("llama")
    fused = patch_causal_lm(clone(plain))
    data = batch(1, vocab=VOCAB, seq=10)
    items = torch.tensor(7)
    torch.testing.assert_close(
        fused(**data, num_items_in_batch=items).loss,
        plain(**data, num_items_in_batch=items).loss,
        rtol=64 * 2.0**-24, atol=0,
    )  # fmt: skip
    # Without labels the original forward runs: the logits are the unpatched ones, bit for bit.
    assert torch.equal(
        fused(input_ids=data["input_ids"]).logits, plain(input_ids=data["input_ids"]).logits
    )
    # logits_to_keep too (generation asks for the last position's logits only).
    last = fused(input_ids=data["input_ids"], logits_to_keep=1).logits
    assert last.shape[1] == 1
    assert torch.equal(last, plain(input_ids=data["input_ids"], logits_to_keep=1).logits)
    as_tuple = fused(**data, return_dict=False)
    assert isinstance(as_tuple, tuple) and as_tuple[0].item() == fused(**data).loss.item()
    assert unpatch_causal_lm(fused).forward.__func__ is type(fused).forward


def test_unsupported_architectures_and_options_are_refused_by_name():
    gemma = causal_lm("gemma2", num_hidden_layers=1, head_dim=8)
    with pytest.raises(ValueError, match="Gemma2ForCausalLM is not one of"):
        patch_causal_lm(gemma)
    model = _model("llama")
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="config.final_logit_softcapping"):
        patch_causal_lm(model)
    fused = patch_causal_lm(_model("llama"))
    data = batch(0, vocab=VOCAB)
    with pytest.raises(ValueError, match="logits_to_keep"):
        fused(**data, logits_to_keep=1)


def test_patched_step_never_creates_a_tokens_by_vocab_tensor(monkeypatch):
    """4 x 20 tokens, vocab 96: logits would be 7,680 elements; nothing else in this model's
    step is that large (attention 6,400, MLP 5,760, the head's gradient 3,072)."""
    monkeypatch.setattr(blocked, "BLOCK_TOKENS", 16)
    monkeypatch.setattr(blocked, "BLOCK_VOCAB", 32)
    data = batch(2, vocab=VOCAB, batch_size=4, seq=20)
    limit = 4 * 20 * VOCAB
    for patched, expect_below in ((False, False), (True, True)):
        model = _model("llama")
        if patched:
            patch_causal_lm(model)
        with LargestTensor() as seen:
            model(**data).loss.backward()
        assert (seen.largest[0] < limit) == expect_below, (patched, seen.largest)


@pytest.mark.parametrize("single_backward", [False, True])
def test_lomo_step_never_creates_the_head_gradient(monkeypatch, single_backward):
    """1 x 8 tokens, vocab 96 x hidden 32: the head's gradient (3,072 elements) is the
    largest matrix of an unpatched Lomo step (logits 768, MLP 576, attention 256, chunks of
    64 vocabulary rows 2,048); with the head stepped from its chunks and the embedding from
    its used rows, no matrix that large appears."""
    monkeypatch.setattr(lce, "CHUNK_ELEMENTS", 64 * TINY["hidden_size"])
    data = batch(3, vocab=VOCAB, batch_size=1, seq=8)
    limit = VOCAB * TINY["hidden_size"]
    allowed = ()
    for patched, expect_below in ((False, False), (True, True)):
        model = _model("llama")
        if patched:
            patch_causal_lm(model)
        opt = Lomo(model, lr=0.05, clip_grad_norm=1.0, single_backward=single_backward)
        with LargestMatrix(allowed) as seen:
            opt.fused_backward(model(**data).loss)
        opt.detach()
        assert (seen.largest[0] < limit) == expect_below, (patched, seen.largest)


def _data(step: int) -> dict[str, torch.Tensor]:
    data = batch(step, vocab=VOCAB, seq=14)
    data["labels"] = _labels_with_ignored(data["input_ids"])
    return data


def _train(model, optimizer_class, single_backward, steps=3, data_for=_data, **kwargs):
    kwargs = {"weight_decay": 0.01, **kwargs}
    opt = optimizer_class(model, lr=0.05, clip_grad_norm=1.0,
                          single_backward=single_backward, **kwargs)  # fmt: skip
    for step in range(steps):
        data = data_for(step)
        if single_backward:
            opt.fused_backward(model(**data).loss, 0.05)
        else:
            opt.grad_norm(model(**data).loss)
            opt.fused_backward(model(**data).loss, 0.05)
    return model


@pytest.mark.parametrize(
    "family,optimizer_class,single_backward,tie",
    [
        ("llama", Lomo, True, True),
        ("qwen2", Lomo, False, True),
        ("llama", AdaLomo, False, True),
        ("qwen2", AdaLomo, True, False),
    ],
)
def test_training_steps_match_unpatched(family, optimizer_class, single_backward, tie):
    """3 steps with clip_grad_norm and weight decay, the head's gradient materialised (tied
    weights, AdaLomo): within the bound of `assert_steps_match`."""
    start = _model(family, tie=tie)
    plain = _train(clone(start), optimizer_class, single_backward)
    fused = _train(patch_causal_lm(clone(start)), optimizer_class, single_backward)
    assert_steps_match(fused, plain, start)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("single_backward", [False, True])
def test_lomo_head_stepped_from_chunks_matches_unpatched(monkeypatch, family, single_backward):
    """An untied head owned by Lomo is stepped from its vocabulary chunks (64 rows: 96 is not
    a multiple), never getting a gradient of its own: 3 steps with clip_grad_norm and weight
    decay, exact and single_backward, within the bound of `assert_steps_match`."""
    monkeypatch.setattr(lce, "CHUNK_ELEMENTS", 64 * TINY["hidden_size"])
    start = _model(family)
    plain = _train(clone(start), Lomo, single_backward)
    materialised = []
    monkeypatch.setattr(lce, "_backward_op", lambda *a: materialised.append(1))
    fused = _train(patch_causal_lm(clone(start)), Lomo, single_backward)
    assert not materialised and fused.lm_head.weight.grad is None
    assert_steps_match(fused, plain, start)


PAD = 7


def _padded_data(step: int) -> dict[str, torch.Tensor]:
    """Ids with duplicates and padding (PAD, ignored by the loss), 28 tokens of 96 ids."""
    data = _data(step)
    data["input_ids"][0, -5:] = PAD
    data["input_ids"][1, :4] = data["input_ids"][1, 4]
    data["labels"] = torch.where(data["input_ids"] == PAD, -100, data["labels"])
    return data


@pytest.mark.parametrize(
    "single_backward,weight_decay", [(False, 0.01), (True, 0.01), (False, 0.0)]
)
def test_lomo_embedding_stepped_from_used_rows_matches_unpatched(
    monkeypatch, single_backward, weight_decay
):
    """The input embedding (padding_idx set, repeated ids) stepped from the rows the batch
    used, every row decayed (or, without weight decay, only the used chunks touched): 3 steps
    against unpatched Lomo within the bound of `assert_steps_match`."""
    from lomo_kernels.ops import embedding as embedding_backward

    monkeypatch.setattr(lce, "CHUNK_ELEMENTS", 64 * TINY["hidden_size"])
    start = _model("llama", pad_token_id=PAD)
    assert start.model.embed_tokens.padding_idx == PAD
    run = dict(data_for=_padded_data, weight_decay=weight_decay)
    plain = _train(clone(start), Lomo, single_backward, **run)
    by_rows = []
    stepped = embedding_backward.step_used_rows
    monkeypatch.setattr(
        embedding_backward, "step_used_rows", lambda *a: by_rows.append(1) or stepped(*a)
    )
    fused = _train(patch_causal_lm(clone(start)), Lomo, single_backward, **run)
    # Exact: grad_norm's pass, then fused_backward's own norm pass (another loss) and update.
    assert len(by_rows) == (3 if single_backward else 9)
    assert fused.model.embed_tokens.weight.grad is None
    assert_steps_match(fused, plain, start)


def test_compiled_model_takes_the_exact_step():
    """A compiled model with the fused loss, compiled afresh (no cached artifact): the first
    backward of its graph is grad_norm's, which keeps the graph, so AOTAutograd compiles that
    backward without donated buffers and the update pass runs it again: the exact step
    completes and updates every parameter. (A backward first compiled reusing its saved
    buffers is refused with nothing changed: tests/core/test_torch_internals.py.)"""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    # torch's own config patches: setting these attributes by hand (monkeypatch) leaves the
    # autograd cache's entry hidden afterwards, and every later compile in the process fails.
    with (
        functorch_config.patch(enable_autograd_cache=False),
        inductor_config.patch(fx_graph_cache=False),
    ):
        torch._dynamo.reset()
        model = patch_causal_lm(_model("llama"))
        compiled = torch.compile(model)
        with Lomo(model, lr=0.05, clip_grad_norm=1.0) as opt:
            out = compiled(**batch(0, vocab=VOCAB))
            assert out.logits is None  # the compiled forward took the fused loss
            loss = out.loss

            def exact_step():
                assert float(opt.grad_norm(loss)) > 0
                opt.fused_backward(loss)

            assert_step_moves(model, exact_step)


def test_a_deep_copy_of_the_patched_model_trains_its_own_weights():
    """copy.deepcopy of a patched model (a reference or EMA copy) computes its loss from the
    copy's weights: trained with Lomo it matches the unpatched model trained alike, and the
    model it was copied from is neither read nor changed (its weights are halved first, so a
    loss read from them would differ)."""
    start = _model("llama")
    original = patch_causal_lm(clone(start))
    copied = clone(original)
    with torch.no_grad():
        for p in original.parameters():
            p.mul_(0.5)
    halved = [p.detach().clone() for p in original.parameters()]
    plain = _train(clone(start), Lomo, False, steps=2)
    fused = _train(copied, Lomo, False, steps=2)
    assert_steps_match(fused, plain, start)
    for p, before in zip(original.parameters(), halved, strict=True):
        assert p.grad is None and torch.equal(p, before)


def test_a_head_replaced_after_patching_is_refused_until_patched_again():
    """resize_token_embeddings replaces the head (and the input embedding): the patched
    forward refuses to compute the loss with the old head, unpatching still works, and
    patching again gives the unpatched model's loss (within the 64 u of
    test_loss_and_gradients_match_unpatched)."""
    model = patch_causal_lm(_model("llama"))
    model.resize_token_embeddings(VOCAB + 8, mean_resizing=False)
    data = _data(0)
    refusal = r"output head was replaced.*patch_causal_lm\(model\) again"
    with pytest.raises(ValueError, match=refusal):
        model(**data)
    plain = lomo_kernels.unpatch_causal_lm(clone(model))  # as refusals name it
    assert plain(**data).logits.shape[-1] == VOCAB + 8
    patch_causal_lm(model)
    assert "forward" in vars(model.get_input_embeddings())  # the new embedding's rows path
    out = model(**data)
    assert out.logits is None
    torch.testing.assert_close(out.loss, plain(**data).loss, rtol=64 * 2.0**-24, atol=0)


def test_a_pickled_patched_model_loads_patched_with_its_own_weights():
    """torch.save(model) of a patched model loads as a patched model (its loss logits-free,
    its gradients on its own parameters), with the loss of the model it was saved from,
    bit for bit; its forward keeps the named parameters transformers' Trainer reads."""
    import inspect
    import pickle

    model = patch_causal_lm(_model("llama"))
    loaded = pickle.loads(pickle.dumps(model))
    assert {"input_ids", "labels"} <= set(inspect.signature(loaded.forward).parameters)
    data = _data(0)
    out = loaded(**data)
    assert out.logits is None
    assert torch.equal(out.loss, model(**data).loss)
    out.loss.backward()
    assert all(p.grad is not None for p in loaded.parameters())
    assert all(p.grad is None for p in model.parameters())
