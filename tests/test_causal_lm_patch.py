"""`patch_causal_lm`: transformers causal LMs whose loss is logits-free, against the same
models unpatched (the unfused head + transformers' own loss)."""

from __future__ import annotations

import pytest
import torch
from float64_reference import ulp
from tiny_models import batch, clone
from torch.utils._python_dispatch import TorchDispatchMode

from lomo_kernels import AdaLomo, Lomo, patch_causal_lm
from lomo_kernels.integrations.causal_lm import unpatch_causal_lm
from lomo_kernels.kernels.blocked import linear_cross_entropy as blocked

VOCAB = 96
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=72, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip


def _model(family: str, tie: bool = False, seed: int = 0) -> torch.nn.Module:
    import transformers

    config_class, model_class = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "mistral": ("MistralConfig", "MistralForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    }[family]
    config = getattr(transformers, config_class)(**SMALL, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    return getattr(transformers, model_class)(config).train()


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
    as_tuple = fused(**data, return_dict=False)
    assert isinstance(as_tuple, tuple) and as_tuple[0].item() == fused(**data).loss.item()
    assert unpatch_causal_lm(fused).forward.__func__ is type(fused).forward


def test_unsupported_architectures_and_options_are_refused_by_name():
    import transformers

    gemma = transformers.Gemma2ForCausalLM(
        transformers.Gemma2Config(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
        )  # fmt: skip
    )
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


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op creates."""

    def __init__(self) -> None:
        super().__init__()
        self.largest: tuple[int, tuple[int, ...], str] = (0, (), "")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() > self.largest[0]:
                self.largest = (t.numel(), tuple(t.shape), str(func))
        return out


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
        with _LargestTensor() as seen:
            model(**data).loss.backward()
        assert (seen.largest[0] < limit) == expect_below, (patched, seen.largest)


def _train(model, optimizer_class, single_backward, steps=3, **kwargs):
    opt = optimizer_class(model, lr=0.05, clip_grad_norm=1.0, weight_decay=0.01,
                          single_backward=single_backward, **kwargs)  # fmt: skip
    for step in range(steps):
        data = batch(step, vocab=VOCAB, seq=14)
        data["labels"] = _labels_with_ignored(data["input_ids"])
        if single_backward:
            opt.fused_backward(model(**data).loss, 0.05)
        else:
            opt.grad_norm(model(**data).loss)
            opt.fused_backward(model(**data).loss, 0.05)
    return model


@pytest.mark.parametrize(
    "family,optimizer_class,single_backward,tie",
    [
        ("llama", Lomo, False, False),
        ("llama", Lomo, True, True),
        ("qwen2", Lomo, False, True),
        ("llama", AdaLomo, False, True),
        ("qwen2", AdaLomo, True, False),
    ],
)
def test_training_steps_match_unpatched(family, optimizer_class, single_backward, tie):
    """3 steps with clip_grad_norm and weight decay: every parameter within 4 ulps of its
    value or 1e-4 of its tensor's largest update over the run."""
    start = _model(family, tie=tie)
    plain = _train(clone(start), optimizer_class, single_backward)
    fused = _train(patch_causal_lm(clone(start)), optimizer_class, single_backward)
    for (name, a), b, s in zip(
        fused.named_parameters(), plain.parameters(), start.parameters(), strict=True
    ):
        a64, b64 = a.detach().double(), b.detach().double()
        largest_update = (b64 - s.detach().double()).abs().max().item()
        bound = torch.maximum(
            4 * ulp(b64, torch.float32), torch.full_like(b64, 1e-4 * largest_update)
        )
        worst = ((a64 - b64).abs() / bound).max().item()
        assert worst <= 1.0, f"{name}: {worst:.3g} x the bound"


def test_compiled_model_norm_pass_refused_clearly_before_any_change():
    """A compiled model with the fused loss: where Inductor's backward reuses the log-sum-exp
    it saved (a donated buffer), torch refuses to keep the graph for a second pass, and
    grad_norm says so and what to do, with every parameter unchanged; where it keeps the
    graph (torch and cache state decide), the exact step completes and updates."""
    model = patch_causal_lm(_model("llama"))
    before = [p.detach().clone() for p in model.parameters()]
    compiled = torch.compile(model)
    with Lomo(model, lr=0.05, clip_grad_norm=1.0) as opt:
        loss = compiled(**batch(0, vocab=VOCAB)).loss
        try:
            opt.grad_norm(loss)
        except RuntimeError as error:
            assert "single_backward=True" in str(error) and "donated" in str(error)
            unchanged = zip(before, model.parameters(), strict=True)
            assert all(torch.equal(a, b) for a, b in unchanged)
        else:
            opt.fused_backward(loss)
            changed = zip(before, model.parameters(), strict=True)
            assert any(not torch.equal(a, b) for a, b in changed)
