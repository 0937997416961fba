"""The eager fast path of the fused ops (`lomo_kernels.ops.eager`).

Eager calls run the backend kernel directly; the results must be bit-identical to the
dispatcher's, the version counters must move the same way, and anything that traces or
intercepts (torch.compile, compiled autograd, FakeTensor, dispatch modes) must still see the
custom op rather than the fast path.
"""

from __future__ import annotations

import pytest
import torch
from support.host_sync import FastPathCalls
from support.models import batch, clone, tiny_llama
from torch._dynamo import compiled_autograd
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from lomo_kernels import AdaLomo, Lomo, ops
from lomo_kernels.ops import backends, eager, lomo

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture
def fast_calls() -> list[str]:
    """Records each fused-op call that took the fast path (the kernel run directly)."""
    with FastPathCalls() as recorder:
        yield recorder.calls


@pytest.fixture
def dispatcher_only(monkeypatch):
    """Returns a context switch: inside it every fused op goes through the dispatcher."""

    class Switch:
        def __enter__(self):
            monkeypatch.setattr(eager, "_nothing_listening", lambda: False)

        def __exit__(self, *exc):
            monkeypatch.undo()

    return Switch()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _sgd_inputs(dtype, n=1000):
    gen = torch.Generator().manual_seed(7)
    param = torch.randn(n, generator=gen).to(dtype)
    grad = (torch.randn(n, generator=gen) * 3).to(dtype)
    grad[5] = float("inf")
    return param, grad


@pytest.mark.parametrize(
    "dtype,sr",
    [(dtype, False) for dtype in DTYPES] + [(torch.bfloat16, True)],
    ids=["fp32", "fp16", "bf16", "bf16_sr"],
)
def test_sgd_update_fast_path_is_bit_identical(backend, dtype, sr, fast_calls, dispatcher_only):
    results = []
    for fast in (True, False):
        param, grad = _sgd_inputs(dtype)
        found_inf = torch.zeros(1)
        seed_step = torch.full((1,), 12345, dtype=torch.int64)
        kwargs = dict(
            lr=torch.full((1,), 0.05),
            inv_scale=0.5,
            clip_value=1.0,
            clip_coef=torch.full((1,), 0.7),
            weight_decay=0.01,
            found_inf=found_inf,
            skip_if=torch.zeros(1),
            stochastic_rounding=sr,
            seed=99,
            seed_step=seed_step if sr else None,
            backend=backend,
        )
        versions = (param._version, found_inf._version)
        fast_calls.clear()
        if fast:
            ops.fused_sgd_update_(param, grad, **kwargs)
            assert fast_calls == ["lomo_kernels::lomo_update_"]
        else:
            with dispatcher_only:
                ops.fused_sgd_update_(param, grad, **kwargs)
            assert fast_calls == []
        bumped = (param._version - versions[0], found_inf._version - versions[1])
        results.append((_bits(param).clone(), found_inf.clone(), bumped))
    (p_fast, f_fast, v_fast), (p_slow, f_slow, v_slow) = results
    assert torch.equal(p_fast, p_slow)
    assert torch.equal(f_fast, f_slow) and f_fast.item() == 1.0
    assert v_fast == v_slow and v_fast[0] > 0 and v_fast[1] > 0


def test_grad_sumsq_fast_path_is_bit_identical(backend, fast_calls, dispatcher_only):
    results = []
    for fast in (True, False):
        _, grad = _sgd_inputs(torch.bfloat16)
        sumsq, found = torch.zeros(1), torch.zeros(1)
        if fast:
            ops.grad_sumsq_(grad, sumsq, inv_scale=0.25, found_inf=found, backend=backend)
        else:
            with dispatcher_only:
                ops.grad_sumsq_(grad, sumsq, inv_scale=0.25, found_inf=found, backend=backend)
        results.append((sumsq._version, found._version, sumsq.clone(), found.clone()))
    assert fast_calls == ["lomo_kernels::grad_sumsq_"]
    assert results[0][:2] == results[1][:2]
    assert torch.equal(results[0][2], results[1][2]) and torch.equal(results[0][3], results[1][3])


@pytest.mark.parametrize("first", [False, True], ids=["add", "first"])
def test_grad_accumulate_fast_path_is_bit_identical(backend, first, fast_calls, dispatcher_only):
    results = []
    for fast in (True, False):
        buffer, grad = _sgd_inputs(torch.bfloat16)  # an inf gradient: found_inf raised
        sumsq, found = torch.zeros(1), torch.zeros(1)
        kwargs = dict(
            first=first,
            inv_scale=0.25,
            sumsq=sumsq,
            found_inf=found,
            stochastic_rounding=True,
            seed=5,
            seed_step=torch.full((1,), 77, dtype=torch.int64),
            backend=backend,
        )
        versions = (buffer._version, sumsq._version, found._version)
        if fast:
            ops.grad_accumulate_(buffer, grad, **kwargs)
        else:
            with dispatcher_only:
                ops.grad_accumulate_(buffer, grad, **kwargs)
        now = (buffer._version, sumsq._version, found._version)
        bumped = tuple(after - before for after, before in zip(now, versions, strict=True))
        results.append((_bits(buffer).clone(), sumsq.clone(), found.clone(), bumped))
    assert fast_calls == ["lomo_kernels::grad_accumulate_"]
    (b_fast, s_fast, f_fast, v_fast), (b_slow, s_slow, f_slow, v_slow) = results
    assert torch.equal(b_fast, b_slow) and torch.equal(f_fast, f_slow) and f_fast.item() == 1.0
    assert torch.equal(s_fast, s_slow)
    assert v_fast == v_slow and v_fast[0] > 0


@pytest.mark.parametrize("shape", [(24, 40), (3, 8, 16), (50,)], ids=str)
def test_adalomo_update_fast_path_is_bit_identical(backend, shape, fast_calls, dispatcher_only):
    results = []
    for fast in (True, False):
        gen = torch.Generator().manual_seed(3)
        param = torch.randn(shape, generator=gen).to(torch.bfloat16)
        grad = torch.randn(shape, generator=gen).to(torch.bfloat16)
        state = ops.init_adalomo_state(param)
        found = torch.zeros(1)
        written = {"param": param, "found_inf": found, **state}
        versions = {name: t._version for name, t in written.items()}
        for step in range(2):
            kwargs = dict(
                lr=0.01,
                beta2=torch.full((1,), 0.9 - step * 0.1),
                weight_decay=0.01,
                inv_scale=0.5,
                clip_value=2.0,
                clip_coef=torch.full((1,), 0.8),
                found_inf=found,
                skip_if=torch.zeros(1),
                backend=backend,
            )
            if fast:
                ops.adalomo_update_(param, grad, state, **kwargs)
            else:
                with dispatcher_only:
                    ops.adalomo_update_(param, grad, state, **kwargs)
        bumped = {name: t._version - versions[name] for name, t in written.items()}
        results.append((_bits(param).clone(), {k: v.clone() for k, v in state.items()}, bumped))
    assert len(fast_calls) == (8 if len(shape) >= 2 else 4)
    (p_fast, s_fast, v_fast), (p_slow, s_slow, v_slow) = results
    # Each op's mutated arguments (one or several) move their counters as the dispatcher's.
    assert v_fast == v_slow and v_fast["param"] > 0
    assert torch.equal(p_fast, p_slow)
    assert s_fast.keys() == s_slow.keys()
    assert all(torch.equal(s_fast[k], s_slow[k]) for k in s_fast)


@pytest.mark.parametrize("optimizer", ["lomo", "lomo_clip_sr", "adalomo", "adalomo_single"])
def test_optimizer_steps_fast_path_is_bit_identical(optimizer, fast_calls, dispatcher_only):
    base = tiny_llama(torch.bfloat16)
    models = []
    for fast in (True, False):
        model = clone(base)
        if optimizer == "lomo":
            opt = Lomo(model, lr=0.05, weight_decay=0.01)
        elif optimizer == "lomo_clip_sr":
            opt = Lomo(model, lr=0.05, clip_grad_norm=1.0, stochastic_rounding=True, seed=4)
        elif optimizer == "adalomo":
            opt = AdaLomo(model, lr=0.01, clip_grad_norm=1.0, clip_grad_value=1.0)
        else:
            opt = AdaLomo(model, lr=0.01, clip_grad_norm=1.0, single_backward=True)
        for step in range(3):
            loss = model(**batch(step)).loss
            if fast:
                opt.fused_backward(loss)
            else:
                with dispatcher_only:
                    opt.fused_backward(loss)
        models.append(model)
    assert fast_calls, "the optimizer's hooks did not take the fast path"
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(_bits(a), _bits(b))


def test_version_bump_keeps_autograd_saved_tensor_check(fast_calls):
    # A tensor saved for backward and then updated in place must still fail loudly.
    param = torch.randn(64)
    x = torch.randn(64, requires_grad=True)
    y = (x * param).sum()  # saves param
    with torch.no_grad():
        ops.fused_sgd_update_(param, torch.ones(64), lr=0.1)
    assert fast_calls == ["lomo_kernels::lomo_update_"]
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_autograd_recording_goes_through_dispatcher(fast_calls):
    # Grad mode on and a leaf requiring grad: the op's autograd layer has a say.
    param = torch.nn.Parameter(torch.randn(16))
    expected = param.detach().clone()
    ops.fused_sgd_update_(expected, torch.ones(16), lr=0.1)
    fast_calls.clear()
    ops.fused_sgd_update_(param, torch.ones(16), lr=0.1)
    assert fast_calls == []
    assert torch.equal(param.detach(), expected)


class _Seen:
    """A mode noting the name of each call it sees, then running it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def _record(self, func, args, kwargs):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


class _DispatchRecorder(_Seen, TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self._record(func, args, kwargs)


class _FunctionRecorder(_Seen, TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self._record(func, args, kwargs)


@pytest.mark.parametrize(
    "mode", [_DispatchRecorder, _FunctionRecorder], ids=["dispatch_mode", "function_mode"]
)
def test_modes_see_the_op(fast_calls, mode):
    param, grad = _sgd_inputs(torch.float32)
    expected = param.clone()
    ops.fused_sgd_update_(expected, grad, lr=0.1)
    fast_calls.clear()
    with mode() as recorder:
        ops.fused_sgd_update_(param, grad, lr=0.1)
    assert "lomo_kernels.lomo_update_.default" in recorder.seen
    assert fast_calls == []
    assert torch.equal(param, expected)


class _Subclass(torch.Tensor):
    """A tensor subclass with torch's own __torch_function__."""


class _NoFunctionSubclass(torch.Tensor):
    """A subclass that opts out of __torch_function__ (as DTensor and Parameter do)."""

    __torch_function__ = torch._C._disabled_torch_function_impl


class _ParameterSubclass(torch.nn.Parameter):
    pass


@pytest.mark.parametrize(
    "where,kind",
    [
        ("grad", _Subclass),
        ("grad", _NoFunctionSubclass),
        ("found_inf", _NoFunctionSubclass),
        ("param", _ParameterSubclass),
    ],
    ids=["grad_subclass", "grad_no_function", "flag_no_function", "param_subclass"],
)
def test_tensor_subclasses_go_through_dispatcher(fast_calls, where, kind):
    param, grad = _sgd_inputs(torch.float32)
    expected, expected_found = param.clone(), torch.zeros(1)
    ops.fused_sgd_update_(expected, grad, lr=0.1, found_inf=expected_found)
    fast_calls.clear()
    tensors = {"param": param, "grad": grad, "found_inf": torch.zeros(1)}
    if kind is _ParameterSubclass:
        tensors[where] = _ParameterSubclass(tensors[where], requires_grad=False)
    else:
        tensors[where] = tensors[where].as_subclass(kind)
    with torch.no_grad():
        ops.fused_sgd_update_(
            tensors["param"], tensors["grad"], lr=0.1, found_inf=tensors["found_inf"]
        )
    assert fast_calls == []
    assert torch.equal(tensors["param"].as_subclass(torch.Tensor), expected)
    assert torch.equal(tensors["found_inf"].as_subclass(torch.Tensor), expected_found)


def test_fast_path_runs_a_replaced_backend_function(monkeypatch, fast_calls):
    """The kernel a call found is reused only while the backend still holds that function."""
    reference = backends.LOMO.resolve(torch.device("cpu"), "torch")
    param, grad = _sgd_inputs(torch.float32)
    ops.fused_sgd_update_(param, grad, lr=0.1, backend=reference)
    seen = []
    original = reference.lomo_update_
    monkeypatch.setattr(
        reference, "lomo_update_", lambda *args: (seen.append(len(args)), original(*args))
    )
    ops.fused_sgd_update_(param, grad, lr=0.1, backend=reference)
    assert seen == [len(lomo.LOMO_UPDATE.names)]
    assert fast_calls == ["lomo_kernels::lomo_update_"] * 2


# The tracer is deprecated but still in torch, and still must see the op.
@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
@pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated")
def test_jit_tracer_sees_the_op(fast_calls):
    param, grad = _sgd_inputs(torch.float32)
    lr = torch.full((1,), 0.1)
    expected = param.clone()
    ops.fused_sgd_update_(expected, grad, lr=lr)
    fast_calls.clear()

    def step(param, grad, lr):
        ops.fused_sgd_update_(param, grad, lr=lr)
        return param

    traced = torch.jit.trace(step, (param, grad, lr), check_trace=False)
    assert "lomo_kernels::lomo_update_" in str(traced.graph)
    assert fast_calls == []
    assert torch.equal(param, expected)


def test_fake_tensors_see_the_op(fast_calls):
    with FakeTensorMode():
        param, grad = torch.randn(32), torch.randn(32)
        ops.fused_sgd_update_(param, grad, lr=torch.full((1,), 0.1))
        scalar = torch.full((1,), 0.1)
        ops.adalomo_update_(param.reshape(4, 8), grad.reshape(4, 8), {}, lr=scalar, beta2=scalar)
    assert fast_calls == []


def _graph_recorder(graphs: list[str]):
    def backend(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    return backend


def test_torch_compile_sees_the_op(fast_calls):
    torch._dynamo.reset()
    graphs: list[str] = []

    def step(param, grad, lr):
        ops.fused_sgd_update_(param, grad, lr=lr, weight_decay=0.01)

    compiled = torch.compile(step, backend=_graph_recorder(graphs), fullgraph=True)
    param, grad = _sgd_inputs(torch.float32)
    expected = param.clone()
    ops.fused_sgd_update_(expected, grad, lr=torch.full((1,), 0.1), weight_decay=0.01)
    fast_calls.clear()
    compiled(param, grad, torch.full((1,), 0.1))
    assert any("lomo_kernels.lomo_update_" in g for g in graphs)
    assert fast_calls == []
    assert torch.equal(param, expected)


@pytest.mark.parametrize("optimizer", ["lomo", "adalomo"])
def test_compiled_autograd_sees_the_op(optimizer, fast_calls):
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.GELU(), torch.nn.Linear(24, 4))
    opt = Lomo(model, lr=0.1) if optimizer == "lomo" else AdaLomo(model, lr=0.01)
    graphs: list[str] = []
    loss = model(torch.randn(8, 16)).pow(2).mean()
    with compiled_autograd._enable(torch.compile(backend=_graph_recorder(graphs))):
        opt.fused_backward(loss)
    op = "lomo_kernels.lomo_update_" if optimizer == "lomo" else "lomo_kernels.adalomo_"
    assert any(op in g for g in graphs)
    assert fast_calls == []


@pytest.mark.gpu_smoke
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("optimizer", ["lomo", "adalomo"])
def test_fast_path_does_not_sync_on_cuda(optimizer, fast_calls):
    model = tiny_llama(torch.bfloat16).cuda()
    opt = Lomo(model, lr=0.05, clip_grad_norm=1.0) if optimizer == "lomo" else AdaLomo(model)
    for step in range(3):
        loss = model(**{k: v.cuda() for k, v in batch(step).items()}).loss
        torch.cuda.set_sync_debug_mode("error")
        try:
            opt.fused_backward(loss)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert fast_calls


FACTORED_PASSES = [
    "lomo_kernels::adalomo_factored_stats_",
    "lomo_kernels::adalomo_factored_moments_",
    "lomo_kernels::adalomo_factored_norm_",
    "lomo_kernels::adalomo_factored_apply_",
]


@pytest.mark.parametrize("listening", ["nothing", "dispatch_mode", "later_pass_subclass"])
def test_adalomo_passes_are_checked_for_the_fast_path_together(fast_calls, listening):
    """An AdaLomo step's passes are checked once for the fast path: all four run directly,
    or, when anything could see one of them, each pass decides on its own as a lone op call
    does: a mode sees them all; a subclass among the tensors of the later passes only sends
    those through the dispatcher. The same bits either way."""
    gen = torch.Generator().manual_seed(3)
    param = torch.randn(9, 13, generator=gen).to(torch.bfloat16)
    grad = torch.randn(9, 13, generator=gen).to(torch.bfloat16)
    kwargs = {"lr": 0.01, "beta2": 0.5, "weight_decay": 0.1, "backend": "cpp"}
    expected, expected_state = param.clone(), ops.init_adalomo_state(param)
    ops.adalomo_update_(expected, grad, expected_state, **kwargs)
    assert fast_calls == FACTORED_PASSES
    fast_calls.clear()
    state = ops.init_adalomo_state(param)
    with torch.no_grad():
        if listening == "dispatch_mode":
            with _DispatchRecorder() as recorder:
                ops.adalomo_update_(param, grad, state, **kwargs)
            seen = [name for name in recorder.seen if name.startswith("lomo_kernels.")]
            assert seen == [f"{n.replace('::', '.')}.default" for n in FACTORED_PASSES]
        else:
            if listening == "later_pass_subclass":  # not read by pass A
                state["exp_avg_sq_col"] = state["exp_avg_sq_col"].as_subclass(_NoFunctionSubclass)
            ops.adalomo_update_(param, grad, state, **kwargs)
    # Pass A reads no column moment: it alone may run directly beside the subclass.
    direct = {
        "nothing": FACTORED_PASSES,
        "dispatch_mode": [],
        "later_pass_subclass": FACTORED_PASSES[:1],
    }
    assert fast_calls == direct[listening]
    assert torch.equal(_bits(param), _bits(expected))
    assert all(
        torch.equal(state[k].as_subclass(torch.Tensor), v) for k, v in expected_state.items()
    )
