"""Sparse embeddings, exceptions raised mid-backward and lomo-optim checkpoints: refused
before any tensor changes, or, where a backward is interrupted after some updates, reported."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from support.dependencies import require
from support.faults import FailingBackward, Interrupted
from support.models import LayerInTwoCheckpoints, batch, loss_of, mlp, tiny_llama
from support.optimizers import OPTIMIZERS
from support.state import (
    assert_refused,
    assert_same_state,
    optimizer_snapshot,
    same_bits,
    tensors,
)

from lomo_kernels import AdaLomo, Lomo

# (constructor options, dtype, whether a norm pass precedes every update pass)
MODES = {
    "plain": ({}, torch.float32, False),
    "clip_norm": ({"clip_grad_norm": 1.0}, torch.float32, True),
    "single_backward": ({"clip_grad_norm": 1.0, "single_backward": True}, torch.float32, False),
    "fp16": ({}, torch.float16, True),
    "fp16_single_backward": ({"single_backward": True}, torch.float16, False),
}


class Embedder(torch.nn.Module):
    """An embedding looked up through nn.Embedding, or a functional op with a sparse gradient
    (`sparse_op`, SPARSE_LOOKUPS)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(12, 6)
        self.head = torch.nn.Linear(6, 3)
        self.sparse_op: str | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.sparse_op is not None:
            x = SPARSE_LOOKUPS[self.sparse_op](ids, self.embed.weight)
        else:
            x = self.embed(ids)
        return self.head(x).float().pow(2).mean()


def gathered_rows(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    rows = ids.reshape(-1, 1).expand(-1, weight.shape[1])
    return torch.gather(weight, 0, rows, sparse_grad=True).reshape(*ids.shape, -1)


# The functional lookups whose gradient is sparse with no module flag to show it.
SPARSE_LOOKUPS = {
    "embedding": lambda ids, weight: F.embedding(ids, weight, sparse=True),
    "gather": gathered_rows,
}


def embedder_loss(model: Embedder, step: int) -> torch.Tensor:
    return model(torch.randint(0, 12, (4, 5), generator=torch.Generator().manual_seed(step)))


def llama_loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    return model(**batch(step)).loss


def make_sparse_functional(model: torch.nn.Module, op: str = "embedding") -> None:
    if isinstance(model, Embedder):
        model.sparse_op = op
        return
    embed = model.model.embed_tokens
    embed.forward = lambda ids: SPARSE_LOOKUPS[op](ids, embed.weight)


def make_sparse_module(model: torch.nn.Module) -> None:
    embed = model.embed if isinstance(model, Embedder) else model.model.embed_tokens
    embed.sparse = True


MODELS = {"embedder": (Embedder, embedder_loss), "llama": (tiny_llama, llama_loss)}


def built(name, model_name, mode):
    options, dtype, _ = MODES[mode]
    make, loss = MODELS[model_name]
    model = make().to(dtype)
    opt = OPTIMIZERS[name](model, lr=0.05, **options)
    opt.fused_backward(loss(model, 0))  # moments, loss scale and norm history under way
    return model, opt, loss


def model_modes():
    for mode in MODES:
        yield pytest.param("embedder", mode, id=f"embedder-{mode}")
    for mode in MODES:
        yield pytest.param("llama", mode, id=f"llama-{mode}")


def changed_parameters(model, before) -> set[str]:
    return {
        n
        for (n, p), b in zip(model.named_parameters(), before, strict=True)
        if not same_bits([p], [b])
    }


# ------------------------------------------------------------------ sparse embeddings


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("model_name,mode", list(model_modes()))
def test_sparse_embedding_module_refused_before_backward(name, model_name, mode):
    model, opt, loss_fn = built(name, model_name, mode)
    make_sparse_module(model)
    loss = loss_fn(model, 1)
    match = r"produces sparse gradients.*sparse = False"
    assert_refused(model, opt, lambda: opt.fused_backward(loss), ValueError, match)
    assert_refused(model, opt, lambda: opt.grad_norm(loss), ValueError, match)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_sparse_embedding_module_refused_at_construction_unless_frozen(name):
    model = Embedder()
    model.embed.sparse = True
    with pytest.raises(ValueError, match="'embed' produces sparse gradients"):
        OPTIMIZERS[name](model)
    model.embed.weight.requires_grad_(False)  # no gradient at all: nothing to refuse
    opt = OPTIMIZERS[name](model, lr=0.1)
    opt.fused_backward(embedder_loss(model, 0))


@pytest.mark.parametrize("op", SPARSE_LOOKUPS)
@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("model_name,mode", list(model_modes()))
def test_functional_sparse_lookup_refused_before_any_change(name, model_name, mode, op):
    """Refused with nothing changed in every mode, the groups' lr included when the call
    passes one: by the norm pass where one runs, else by a walk of the loss's autograd graph
    before the update pass."""
    model, opt, loss_fn = built(name, model_name, mode)
    make_sparse_functional(model, op)
    loss = loss_fn(model, 1)
    if MODES[mode][2]:
        error, match = TypeError, r"received a sparse gradient.*sparse=False"
    else:
        error, match = ValueError, r"gives a sparse gradient.*nothing was updated"
    assert_refused(model, opt, lambda: opt.fused_backward(loss), error, match)
    assert_refused(model, opt, lambda: opt.fused_backward(loss, lr=0.5), error, match)
    assert not opt.last_step_interrupted


# ------------------------------------------------------------------ mid-backward exceptions


def raise_in_backward(model: torch.nn.Module, how: str, passes: int = 0) -> Any:
    """Makes the backward through the model's first block raise, after `passes` clean ones."""
    first = model[0] if isinstance(model, torch.nn.Sequential) else model.model.layers[0]
    calls = []

    def fail(*_args):
        calls.append(1)
        if len(calls) > passes:
            raise Interrupted("from the model")

    if how == "module_hook":
        return first.register_full_backward_hook(lambda *args: fail())
    if how == "tensor_hook":
        return first.register_forward_hook(lambda m, i, out: _hooked(out, fail))
    return first.register_forward_hook(lambda m, i, out: _failing(out, fail))


def _hooked(out, fail):
    (out[0] if isinstance(out, tuple) else out).register_hook(lambda grad: fail())


def _failing(out, fail):
    """The output through a module whose backward raises."""
    if isinstance(out, tuple):
        return (FailingBackward.apply(out[0], fail), *out[1:])
    return FailingBackward.apply(out, fail)


def assert_reported(model, opt, before, error) -> None:
    """The report names every parameter that changed, and the note says how many."""
    assert opt.last_step_interrupted
    names = opt.last_step_partial_names
    assert names and changed_parameters(model, before) <= set(names)
    assert f"after {len(names)} of" in "\n".join(error.__notes__)
    assert "partly stepped" in "\n".join(error.__notes__)


HOW = ["module_hook", "tensor_hook", "module_backward"]


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("mode", ["plain", "single_backward", "fp16_single_backward"])
@pytest.mark.parametrize("model_name", ["mlp", "llama"])
def test_exception_in_update_pass_reported(name, how, mode, model_name):
    options, dtype, _ = MODES[mode]
    model = (mlp() if model_name == "mlp" else tiny_llama()).to(dtype)
    opt = OPTIMIZERS[name](model, lr=0.05, **options)
    loss_fn = loss_of if model_name == "mlp" else llama_loss
    opt.fused_backward(loss_fn(model, 0))
    raise_in_backward(model, how)
    before = [p.detach().clone() for p in model.parameters()]
    state_before = {id(p): [v.clone() for v in opt.state[p].values()] for p in opt.state}
    loss = loss_fn(model, 1)
    with pytest.raises(Interrupted) as raised:
        opt.fused_backward(loss)
    assert_reported(model, opt, before, raised.value)
    names = set(opt.last_step_partial_names)
    for n, p in model.named_parameters():
        if n not in names and p in opt.state:
            assert same_bits(state_before[id(p)], list(opt.state[p].values()))


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("mode", ["clip_norm", "fp16"])
def test_exception_in_norm_pass_changes_nothing(name, how, mode):
    options, dtype, _ = MODES[mode]
    model = mlp().to(dtype)
    opt = OPTIMIZERS[name](model, lr=0.05, **options)
    opt.fused_backward(loss_of(model, 0))
    raise_in_backward(model, how)
    loss = loss_of(model, 1)
    call = lambda: opt.fused_backward(loss, lr=0.5)  # noqa: E731  (the lr is left too)
    assert_refused(model, opt, call, Interrupted, "from the model")
    assert not opt.last_step_interrupted and opt.last_step_partial_names == []


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("mode", MODES)
def test_a_call_lr_stands_in_for_the_groups_own(name, mode):
    """The call's lr is checked in place of the groups' (an invalid group lr is overwritten,
    as lomo-optim's assignment does) in every mode, the norm pass's included, and the step
    takes it as a constructor's lr would be taken."""
    options, dtype, _ = MODES[mode]
    model, reference = mlp().to(dtype), mlp().to(dtype)
    opt = OPTIMIZERS[name](model, lr=0.05, **options)
    expected = OPTIMIZERS[name](reference, lr=0.05, **options)
    opt.param_groups[0]["lr"] = float("nan")
    opt.fused_backward(loss_of(model, 0), lr=0.1)
    expected.fused_backward(loss_of(reference, 0), lr=0.1)
    assert [g["lr"] for g in opt.param_groups] == [0.1]
    assert same_bits(list(model.parameters()), list(reference.parameters()))


@pytest.mark.parametrize("mode", ["plain", "clip_norm", "single_backward", "fp16"])
def test_a_refused_adalomo_state_leaves_the_call_lr(mode):
    """AdaLomo's check of its moments, the last check before the update, refuses a damaged
    state with nothing changed, the groups' lr included, whatever the step's plan."""
    model, opt, loss_fn = built("adalomo", "embedder", mode)
    opt.state[model.head.weight]["exp_avg_sq_row"] = torch.zeros(2)
    loss = loss_fn(model, 1)
    call = lambda: opt.fused_backward(loss, lr=0.5)  # noqa: E731
    assert_refused(model, opt, call, ValueError, "exp_avg_sq_row")


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("mode", MODES)
def test_an_update_pass_failing_before_any_update_leaves_the_call_lr(name, mode):
    """An exception in the update pass before any parameter is updated (raised where the
    loss's gradient arrives, after the norm pass where one runs) leaves the parameters, the
    optimizer state and its state_dict (step count, loss scaler, norm history, param groups)
    as they were, the lr the call was given included, as its note says. (The norm pass's
    measurement, when one ran, stays in the step reports and device scalars.)"""
    model, opt, loss_fn = built(name, "embedder", mode)
    loss = loss_fn(model, 1)
    calls = []

    def fail(grad: torch.Tensor) -> None:
        calls.append(1)
        if len(calls) > MODES[mode][2]:  # the norm pass's backward passes
            raise Interrupted("from the loss")

    loss.register_hook(fail)
    kept = ("parameters", "state", "state_dict")
    before = {key: optimizer_snapshot(model, opt)[key] for key in kept}
    with pytest.raises(Interrupted, match="from the loss") as raised:
        opt.fused_backward(loss, lr=0.5)
    after = {key: optimizer_snapshot(model, opt)[key] for key in kept}
    assert_same_state(before, after, "snapshot")
    assert "before any parameter was updated" in "\n".join(raised.value.__notes__)


def test_a_step_from_the_buffers_refused_leaves_the_last_call_lr():
    """The last micro-batch's call applies the step from the buffers; refused there before
    any update (AdaLomo's damaged moments), the micro-batches are dropped with the
    parameters unchanged, and the lr the call was given is given back."""
    model = Embedder()
    opt = AdaLomo(model, lr=0.05, accumulation_steps=2)
    for step in range(3):  # a step, then one micro-batch of the next
        opt.fused_backward(embedder_loss(model, step) / 2)
    opt.state[model.head.weight]["exp_avg_sq_row"] = torch.zeros(2)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="exp_avg_sq_row"):
        opt.fused_backward(embedder_loss(model, 3) / 2, lr=0.5)
    assert [g["lr"] for g in opt.param_groups] == [0.05] and opt.pending_micro_batches == 0
    assert same_bits(list(model.parameters()), before)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_failed_micro_batch_leaves_the_lr_and_the_next_one_takes_it(name):
    """A micro-batch whose backward raises is dropped whole, the lr it was given included;
    the lr of a micro-batch that is taken is the groups' from then on, and the step's."""
    model = mlp()
    reference = copy.deepcopy(model)
    opt = OPTIMIZERS[name](model, lr=0.05, accumulation_steps=2)
    handle = raise_in_backward(model, "module_hook")
    with pytest.raises(Interrupted):
        opt.fused_backward(loss_of(model, 0) / 2, lr=0.5)
    assert [g["lr"] for g in opt.param_groups] == [0.05] and opt.pending_micro_batches == 0
    handle.remove()
    opt.fused_backward(loss_of(model, 0) / 2, lr=0.5)
    assert [g["lr"] for g in opt.param_groups] == [0.5]
    opt.fused_backward(loss_of(model, 1) / 2)
    # The same two micro-batches through an optimizer given lr=0.5 from the start.
    expected = OPTIMIZERS[name](reference, lr=0.5, accumulation_steps=2)
    for step in range(2):
        expected.fused_backward(loss_of(reference, step) / 2)
    assert same_bits(list(model.parameters()), list(reference.parameters()))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_exception_in_update_pass_after_norm_pass_reported_and_reset(name):
    model = mlp()
    opt = OPTIMIZERS[name](model, lr=0.05, clip_grad_norm=1.0)
    raise_in_backward(model, "module_hook", passes=1)  # the norm pass succeeds
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(Interrupted) as raised:
        opt.fused_backward(loss_of(model, 0))
    assert_reported(model, opt, before, raised.value)
    assert sorted(opt.last_step_partial_names) == ["2.bias", "2.weight"]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_report_reset_at_the_next_step(name):
    model = mlp()
    opt = OPTIMIZERS[name](model, lr=0.05)
    handle = raise_in_backward(model, "module_hook")
    with pytest.raises(Interrupted):
        opt.fused_backward(loss_of(model, 0))
    assert opt.last_step_interrupted
    handle.remove()
    opt.fused_backward(loss_of(model, 1))
    assert not opt.last_step_interrupted and opt.last_step_partial_names == []


def test_exception_under_compiled_autograd_says_the_updates_are_unknown():
    """Traced hooks run inside one graph: the optimizer cannot list what they updated."""
    from torch._dynamo import compiled_autograd

    model = mlp()
    opt = Lomo(model, lr=0.05)
    raise_in_backward(model, "module_backward")
    loss = loss_of(model, 0)
    compiled = compiled_autograd._enable(torch.compile(backend="aot_eager"))
    with pytest.raises(Interrupted) as raised, compiled:
        opt.fused_backward(loss)
    assert opt.last_step_interrupted and opt.last_step_partial_names == []
    assert "cannot tell which parameters were updated" in raised.value.__notes__[0]


# ------------------------------------------------------------------ lomo-optim checkpoints


@pytest.fixture
def lomo_optim(monkeypatch):
    """lomo_optim.AdaLomo allocates its moments with a hard-coded .cuda(): keep them on CPU."""
    module = require("lomo_optim")
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
    return module


def frozen_bias_mlp():
    model = mlp()
    model[0].bias.requires_grad_(False)  # lomo-optim lists frozen parameters too
    return model


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_lomo_optim_state_loads_its_hyper_parameters(name, lomo_optim):
    writer = {"lomo": lomo_optim.Lomo, "adalomo": lomo_optim.AdaLomo}[name]
    # lomo-optim's AdaLomo decays only where weight_decay > 0: a negative value means off.
    decay = {"weight_decay": -0.5} if name == "adalomo" else {}
    saved = writer(frozen_bias_mlp(), lr=0.02, clip_grad_norm=2.0, clip_grad_value=-1.0, **decay)
    model = frozen_bias_mlp()
    opt = OPTIMIZERS[name](model, lr=0.05, weight_decay=0.01)
    opt.fused_backward(loss_of(model, 0))
    kept = tensors(model, opt)
    if name == "adalomo":
        with pytest.warns(UserWarning, match="no second moments"):
            opt.load_state_dict(saved.state_dict())
    else:
        opt.load_state_dict(saved.state_dict())
    group = opt.param_groups[0]
    assert (group["lr"], group["clip_grad_norm"], group["clip_grad_value"]) == (0.02, 2.0, -1.0)
    assert group["weight_decay"] == (0.0 if name == "adalomo" else 0.01)
    assert opt.step_count == 1 and same_bits(kept, tensors(model, opt))
    opt.fused_backward(loss_of(model, 1))


@pytest.mark.parametrize("writer,reader", [("Lomo", "adalomo"), ("AdaLomo", "lomo")])
def test_lomo_optim_state_of_the_other_class_refused(writer, reader, lomo_optim):
    saved = getattr(lomo_optim, writer)(mlp(), lr=0.02)
    model = mlp()
    opt = OPTIMIZERS[reader](model, lr=0.05)
    opt.fused_backward(loss_of(model, 0))
    load = lambda: opt.load_state_dict(saved.state_dict())  # noqa: E731
    assert_refused(model, opt, load, ValueError, f"written by lomo_optim.{writer}")


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("other", ["smaller", "larger"])
def test_lomo_optim_state_of_another_model_refused(name, other, lomo_optim):
    writer = {"lomo": lomo_optim.Lomo, "adalomo": lomo_optim.AdaLomo}[name]
    if other == "smaller":
        written, count = torch.nn.Linear(3, 3), 2
    else:
        written, count = torch.nn.Sequential(mlp(), torch.nn.Linear(3, 3)), 6
    saved = writer(written, lr=0.02)
    model = mlp()
    opt = OPTIMIZERS[name](model, lr=0.05)
    load = lambda: opt.load_state_dict(saved.state_dict())  # noqa: E731
    assert_refused(model, opt, load, ValueError, f"lists {count} parameters, this model has 4")


def test_lomo_optim_state_with_a_bad_value_refused(lomo_optim):
    saved = lomo_optim.AdaLomo(mlp(), lr=0.02).state_dict()
    saved["param_groups"][0]["eps"] = (float("nan"), 1e-3)
    model = mlp()
    opt = AdaLomo(model, lr=0.05)
    assert_refused(model, opt, lambda: opt.load_state_dict(saved), ValueError, "eps must be")
    assert opt.param_groups[0]["eps"] == (1e-30, 1e-3)


def test_lomo_optim_keys_with_per_parameter_state_refused(lomo_optim):
    """lomo-optim keeps no per-parameter state: a dict with its group keys and a "state"
    entry is neither its nor ours, refused instead of loaded with the state ignored."""
    saved = lomo_optim.AdaLomo(mlp(), lr=0.02).state_dict()
    saved["state"] = {0: {"exp_avg_sq_row": torch.ones(8), "exp_avg_sq_col": torch.ones(6)}}
    model = mlp()
    opt = AdaLomo(model, lr=0.05)
    opt.fused_backward(loss_of(model, 0))
    load = lambda: opt.load_state_dict(saved)  # noqa: E731
    assert_refused(model, opt, load, ValueError, "differs from this optimizer's in the hyper")


def test_lomo_optim_state_not_mistaken_for_ours():
    model = mlp()
    opt = Lomo(model, lr=0.05)
    own = opt.state_dict()
    del own["lomo"]  # an older checkpoint of ours: loads as before
    Lomo(mlp()).load_state_dict(own)


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("mode", MODES)
def test_gradient_in_parts_refused_or_reported(name, mode):
    """Stepping each part would decay, clamp and (AdaLomo) normalise the layer twice: with a
    norm pass the step is refused before any change, without one it stops at the second
    part and reports what it updated."""
    options, dtype, norm_pass = MODES[mode]
    model = LayerInTwoCheckpoints().to(dtype)
    opt = OPTIMIZERS[name](model, lr=0.05, weight_decay=0.1, **options)
    x = torch.randn(5, 40, generator=torch.Generator().manual_seed(0), dtype=dtype)
    loss = model(x.requires_grad_())
    match = "'layer.bias' got a second gradient in the same backward.*use_reentrant=False"
    if norm_pass:
        assert_refused(model, opt, lambda: opt.fused_backward(loss), RuntimeError, match)
        return
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=match) as raised:
        opt.fused_backward(loss)
    assert_reported(model, opt, before, raised.value)
