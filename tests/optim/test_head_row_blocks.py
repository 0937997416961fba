"""A Lomo stepping the fused head's weight from its vocabulary chunks' gradients
(`optim/row_blocks.py`): stochastic rounding chunk by chunk equals the whole tensor's, an
overflow in one chunk follows the whole-tensor rules, bf16 against the materialised path,
and a second gradient for the same weight is refused."""

from __future__ import annotations

import pytest
import torch
from support.float64 import ulp
from support.models import batch, clone, max_rel_diff, tiny_llama
from support.recording import record_lomo_calls
from support.state import snapshot, unchanged

import lomo_kernels
from lomo_kernels import Lomo, patch_causal_lm
from lomo_kernels.ops import cross_entropy as lce
from lomo_kernels.ops.cross_entropy import blocked_backend as blocked
from lomo_kernels.optim.step import Phase

HIDDEN = 32
CHUNK_ROWS = 64  # vocab 96: chunks of 64 and 32 rows


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(lce, "CHUNK_ELEMENTS", CHUNK_ROWS * HIDDEN)


@pytest.mark.parametrize("backend", ["torch", "cpp", "triton"])
def test_stochastic_rounding_by_chunks_equals_the_whole_tensor(backend, monkeypatch):
    """bf16, 53 x 24 (rows of 24 elements: chunks at flat offsets 408 and 960, no power of
    two): the rows stepped in three chunks, one update call each at its flat offset, are
    bit-identical to the whole tensor stepped at once, and differ from round-to-nearest (the
    rounding is stochastic)."""
    calls = record_lomo_calls(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(53, 24, generator=gen).to(torch.bfloat16)
    grad = torch.randn(53, 24, generator=gen) * 3.0
    results = []
    for chunks, rounding in (((0, 17, 40, 53), True), ((0, 53), True), ((0, 53), False)):
        module = torch.nn.Linear(24, 53, bias=False).to(torch.bfloat16)
        module.weight.data.copy_(weight)
        opt = Lomo(module, lr=0.1, weight_decay=0.01, stochastic_rounding=rounding, seed=5,
                   backend=backend)  # fmt: skip
        opt._prepare_scalars()
        opt._step.begin_pass(Phase.UPDATE)
        rows = opt.row_block_step(module.weight)
        for start, stop in zip(chunks[:-1], chunks[1:], strict=True):
            rows.apply(start, stop, grad[start:stop])
        opt._step.end_pass()
        opt.detach()
        results.append(module.weight.detach().clone())
        offsets = [args["offset"] for op, args in calls if op == "lomo_update_"]
        assert offsets == [start * 24 for start in chunks[:-1]]
        calls.clear()
    by_chunks, whole, nearest = results
    assert torch.equal(by_chunks.view(torch.int16), whole.view(torch.int16))
    assert not torch.equal(whole, nearest)


def _inject_inf_in_second_chunk(monkeypatch) -> list[int]:
    """Makes the head's second chunk's gradient non-finite; returns a list that records each
    materialised head gradient (none while the head is stepped from its chunks)."""
    plain = blocked.backward_chunk
    materialised: list[int] = []
    monkeypatch.setattr(lce, "_backward_op", lambda *a: materialised.append(1))

    def backward_chunk(*args):
        plain(*args)
        vocab_start, d_weight_chunk = args[5], args[7]
        if vocab_start == CHUNK_ROWS and d_weight_chunk is not None:
            d_weight_chunk[3, 5] = torch.inf

    monkeypatch.setattr(blocked, "backward_chunk", backward_chunk)
    return materialised


def test_fp16_overflow_in_one_head_chunk_changes_nothing_in_the_exact_mode(monkeypatch):
    """The norm pass meets the overflow in the head's second chunk before any update: every
    parameter keeps its bits, the loss scale halves, the step is reported skipped."""
    model = patch_causal_lm(tiny_llama(torch.float16))
    before = snapshot(model)
    opt = Lomo(model, lr=0.05, clip_grad_norm=1.0, weight_decay=0.01)
    materialised = _inject_inf_in_second_chunk(monkeypatch)
    opt.fused_backward(model(**batch(0)).loss)
    opt.flush_report()
    assert not materialised
    assert unchanged(model, before)
    assert opt.last_step_skipped and opt.loss_scaler.scale.item() == 2.0**15
    assert model.lm_head.weight.grad is None


def test_fp16_overflow_in_one_head_chunk_single_backward_leaves_the_head_whole(monkeypatch):
    """single_backward: the head's chunks are measured before any of them is written, so the
    head is left unchanged whole (not only its non-finite elements); the other tensors are
    updated and the step is partial, as for any tensor with a non-finite gradient."""
    model = patch_causal_lm(tiny_llama(torch.float16))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = Lomo(model, lr=0.05, clip_grad_norm=1.0, single_backward=True)
    materialised = _inject_inf_in_second_chunk(monkeypatch)
    with pytest.warns(RuntimeWarning):
        opt.fused_backward(model(**batch(0)).loss)
        opt.flush_report()
    assert not materialised
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert "lm_head.weight" not in changed and "model.norm.weight" in changed
    assert opt.last_step_partial and opt.loss_scaler.scale.item() == 2.0**15


@pytest.mark.gpu_smoke
def test_bf16_head_and_embedding_by_blocks_against_the_materialised_gradients(
    monkeypatch, test_device
):
    """bf16, one step without clipping, on the test device: every tensor but the head and
    the input embedding is bit-identical to the step with their gradients materialised in
    bf16; those two differ only by the materialised gradients' rounding, times lr (half a
    bf16 ulp of the gradient per rounding: one for the head, one per summed occurrence of an
    id for the embedding), and the write-back's (one ulp of the result)."""
    start = tiny_llama(torch.bfloat16).to(test_device)
    data = {key: value.to(test_device) for key, value in batch(1).items()}

    def step(model, by_blocks):
        if not by_blocks:  # not elementwise: the head and embedding get whole gradients
            monkeypatch.setattr(Lomo, "elementwise", False)
        opt = Lomo(model, lr=0.05, weight_decay=0.01)
        opt.fused_backward(model(**data).loss)
        opt.detach()
        return model

    by_blocks = step(patch_causal_lm(clone(start)), True)
    whole = step(patch_causal_lm(clone(start)), False)
    plain = clone(start)
    plain(**data).loss.backward()
    roundings = {
        "lm_head.weight": 1,
        "model.embed_tokens.weight": int(torch.bincount(data["input_ids"].reshape(-1)).max()),
    }
    grads = dict(plain.named_parameters())
    for (name, a), b in zip(by_blocks.named_parameters(), whole.parameters(), strict=True):
        if name not in roundings:
            assert torch.equal(a, b), name
            continue
        a64, b64 = a.double(), b.double()
        gradient_error = roundings[name] * 0.5 * ulp(grads[name].grad.double(), torch.bfloat16)
        bound = 0.05 * gradient_error + ulp(b64, torch.bfloat16)
        assert bool(((a64 - b64).abs() <= bound).all()), name
        assert not torch.equal(a, grads[name]), name


def test_a_second_gradient_for_the_chunked_head_is_refused_before_any_change():
    """The head weight used once more besides the fused loss: the exact mode's norm pass
    refuses it, naming the parameter, with every parameter unchanged."""
    model = patch_causal_lm(tiny_llama())
    before = snapshot(model)
    opt = Lomo(model, lr=0.05, clip_grad_norm=1.0)
    loss = model(**batch(2)).loss + model.lm_head.weight.square().sum() * 1e-3
    with pytest.raises(RuntimeError, match="'lm_head.weight' is stepped in backward from"):
        opt.fused_backward(loss)
    assert unchanged(model, before)


def test_a_whole_gradient_before_the_head_blocks_is_refused_before_any_change():
    """The head weight used once more after the fused loss, inside a reentrant checkpoint:
    the read of the loss's graph does not reach that use, whose backward runs first and
    hands the whole gradient over before the head's blocks come. The norm pass refuses the
    blocks then, naming the parameter, with every parameter unchanged."""
    from torch.utils.checkpoint import checkpoint

    model = patch_causal_lm(tiny_llama())
    before = snapshot(model)
    opt = Lomo(model, lr=0.05, clip_grad_norm=1.0)
    weight, one = model.lm_head.weight, torch.ones((), requires_grad=True)
    head_loss = model(**batch(2)).loss
    reused = checkpoint(lambda s: weight.square().sum() * s, one, use_reentrant=True)
    # Runs after the optimizer's own hook, so only where that one took the whole gradient.
    taken = []
    weight.register_post_accumulate_grad_hook(lambda p: taken.append("whole"))
    with pytest.raises(RuntimeError, match="'lm_head.weight' is stepped in backward from"):
        opt.fused_backward(head_loss + reused * 1e-3)
    assert taken == ["whole"]  # the whole gradient came first, the blocks were refused
    assert unchanged(model, before)


@pytest.mark.parametrize("clip", [1.0, None], ids=["norm_pass", "graph_read"])
def test_the_chunked_head_run_twice_for_one_loss_is_refused_before_any_change(clip):
    """Two forwards of the patched model summed into one loss: the head's op (and the input
    embedding's) hands over blocks twice, which would step the weights twice (weight decay
    applied twice). The norm pass refuses the second set of blocks as it arrives; without
    one, the read of the graph refuses it. Every parameter unchanged either way."""
    model = patch_causal_lm(tiny_llama())
    before = snapshot(model)
    opt = Lomo(model, lr=0.05, weight_decay=0.01, clip_grad_norm=clip)
    loss = model(**batch(2)).loss + model(**batch(3)).loss
    with pytest.raises(RuntimeError, match=r"'.*\.weight' is stepped in backward from"):
        opt.fused_backward(loss)
    assert unchanged(model, before)


@pytest.mark.parametrize(
    "options", [{"clip_grad_norm": None}, {"clip_grad_norm": 1.0, "single_backward": True}]
)
@pytest.mark.parametrize("reused", ["lm_head", "embed_tokens"])
def test_a_second_gradient_is_refused_before_any_change_without_a_norm_pass(options, reused):
    """With no norm pass to meet it first (no clipping, or single_backward), the graph is
    read before the backward: a block-stepped weight (the head, the input embedding) that the
    loss also uses elsewhere is refused, naming it, with every parameter unchanged."""
    model = patch_causal_lm(tiny_llama())
    before = snapshot(model)
    opt = Lomo(model, lr=0.05, **options)
    weight = model.get_submodule(f"model.{reused}" if reused == "embed_tokens" else reused).weight
    loss = model(**batch(2)).loss + weight.square().sum() * 1e-3
    with pytest.raises(RuntimeError, match=f"'.*{reused}.weight' is stepped .* Nothing was"):
        opt.fused_backward(loss)
    assert unchanged(model, before)
    # The same model steps once the loss uses each weight once.
    opt.fused_backward(model(**batch(2)).loss)
    assert not unchanged(model, before)


def test_used_rows_are_the_dense_gradients_nonzero_rows():
    """The used rows' fp32 sums against the float64 dense embedding gradient (padding row
    zeroed, as torch's): the same rows, each within k u of its sum of magnitudes (k
    occurrences of the id summed in fp32), and no other row of the dense gradient non-zero."""
    from lomo_kernels.ops.embedding import used_rows

    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 40, (3, 17), generator=gen)
    ids[0, :6] = 11  # repeated
    ids[2, -4:] = 0  # padding
    grad = torch.randn(3, 17, 24, generator=gen)
    rows, sums = used_rows(grad, ids, padding_idx=0)
    flat_ids, flat = ids.reshape(-1), grad.reshape(-1, 24).double()
    dense = torch.zeros(40, 24, dtype=torch.float64).index_add_(0, flat_ids, flat)
    magnitude = torch.zeros_like(dense).index_add_(0, flat_ids, flat.abs())
    dense[0] = 0.0
    count = torch.bincount(flat_ids, minlength=40).double()[:, None]
    assert rows.tolist() == sorted(set(flat_ids.tolist()) - {0})
    bound = count[rows] * 2.0**-24 * magnitude[rows]
    assert bool(((sums.double() - dense[rows]).abs() <= bound).all())
    others = torch.ones(40, dtype=torch.bool)
    others[rows] = False
    assert bool((dense[others] == 0).all())


@pytest.mark.parametrize(
    "optimizer,tie,given",
    [("adalomo", False, "model"), ("lomo", True, "model"), ("lomo", True, "parameters")],
)
def test_adalomo_and_tied_weights_get_whole_gradients(monkeypatch, optimizer, tie, given):
    """AdaLomo (statistics over the whole matrix) and a tied head/embedding (two
    contributions) fall back to the materialised head gradient and the dense embedding
    gradient, stepped by the hooks; their equality with unpatched training is
    test_causal_lm_patch's. The tie is found in the model's parameter names or, for an
    optimizer given the parameters (which list a tied weight once), in the patched head."""
    from lomo_kernels import AdaLomo
    from lomo_kernels.ops import embedding as embedding_backward

    materialised, by_rows = [], []
    whole_head, rows = lce._backward_op, embedding_backward.step_used_rows
    monkeypatch.setattr(lce, "_backward_op", lambda *a: materialised.append(1) or whole_head(*a))
    monkeypatch.setattr(embedding_backward, "step_used_rows", lambda *a: by_rows.append(rows(*a)))
    model = patch_causal_lm(tiny_llama(tie_word_embeddings=tie))
    before = [p.detach().clone() for p in model.parameters()]
    trained = model if given == "model" else model.parameters()
    opt = (AdaLomo if optimizer == "adalomo" else Lomo)(trained, lr=0.05, clip_grad_norm=1.0)
    opt.fused_backward(model(**batch(4)).loss)
    assert materialised == [1, 1] and by_rows == []  # the norm pass and the update pass
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_the_norm_pass_measures_the_embedding_s_used_rows_in_one_block(monkeypatch):
    """A norm pass only measures, so the input embedding hands over its used rows' sums
    (at most tokens x hidden) in one block instead of scattering them into chunks of its
    dense rows, which the update pass writes (64 and 32 rows here)."""
    from lomo_kernels.optim.row_blocks import RowBlockStep

    model = patch_causal_lm(tiny_llama())
    embedding = model.model.embed_tokens
    seen = []
    apply = RowBlockStep.apply

    def recording(self, start: int, stop: int, grad: torch.Tensor) -> None:
        if self._piece.param is embedding.weight:
            seen.append((self._blocks.step.phase, start, stop, tuple(grad.shape)))
        apply(self, start, stop, grad)

    monkeypatch.setattr(RowBlockStep, "apply", recording)
    opt = Lomo(model, lr=0.05, clip_grad_norm=1.0)
    inputs = batch(4)
    ids, pad = torch.unique(inputs["input_ids"]), embedding.padding_idx
    used = ids.numel() if pad is None else int((ids != pad).sum())  # no padding row
    opt.fused_backward(model(**inputs).loss)
    vocab = embedding.num_embeddings
    assert [s for s in seen if s[0] is Phase.NORM] == [(Phase.NORM, 0, vocab, (used, HIDDEN))]
    chunks = [s[1:3] for s in seen if s[0] is Phase.UPDATE]
    assert chunks and all(stop - start <= CHUNK_ROWS for start, stop in chunks)


class TiedCustomLM(torch.nn.Module):
    """A small language model of the user's own whose head is tied to its input embedding
    (``head.weight = embed.weight``) and whose loss is the public logits-free function: the
    weight gets the embedding's gradient and the head's, so no row block may step it."""

    def __init__(self, vocab: int = 96, width: int = HIDDEN) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.embed = torch.nn.Embedding(vocab, width)
        self.mix = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        with torch.no_grad():
            for p in (self.embed.weight, self.mix.weight, self.mix.bias):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.mix(self.embed(ids)))
        return lomo_kernels.ops.linear_cross_entropy(hidden, self.head.weight, labels)


def test_a_tied_weight_of_a_custom_model_is_stepped_whole_as_sgd_steps_it():
    """The tie is found in the model's parameter names (no patched head to tell it): the
    weight is stepped once, from its summed gradient, and three steps equal torch's SGD on
    the same model and loss (the fp32 bound of the optimizer tests against SGD). Stepped
    from the head's chunks, the embedding's gradient would come second."""
    gen = torch.Generator().manual_seed(4)
    data = [(torch.randint(0, 96, (2, 9), generator=gen),) * 2 for _ in range(3)]
    ours, ref = TiedCustomLM(), TiedCustomLM()
    opt = Lomo(ours, lr=0.05)
    sgd = torch.optim.SGD(ref.parameters(), lr=0.05)
    for ids, labels in data:
        opt.fused_backward(ours(ids, labels.roll(-1, dims=1)))
        sgd.zero_grad()
        ref(ids, labels.roll(-1, dims=1)).backward()
        sgd.step()
    assert max_rel_diff(ours, ref) <= 1e-6
    assert not torch.equal(ours.embed.weight, TiedCustomLM().embed.weight)


def test_a_plain_backward_through_the_fused_head_alone_is_refused():
    """With the head the only trained parameter, a plain ``loss.backward()`` is refused by
    the head's hook, every time it is tried (the head's chunks are not taken outside
    fused_backward, so no pass notes them as stepped); nothing changes, and the optimizer
    steps as usual afterwards."""
    model = patch_causal_lm(tiny_llama())
    for p in model.parameters():
        p.requires_grad_(p is model.lm_head.weight)
    opt = Lomo(model, lr=0.05)
    before, head = snapshot(model), model.lm_head.weight.detach().clone()
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"outside opt\.fused_backward\(loss\)"):
            model(**batch(0)).loss.backward()
    assert unchanged(model, before) and opt.attached
    opt.fused_backward(model(**batch(0)).loss)
    assert not torch.equal(model.lm_head.weight, head)
