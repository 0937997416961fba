"""Registration with torch.library, backend selection and input validation."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from lomo_kernels import ops
from lomo_kernels.ops import backends


def test_compiled_function_calls_op_without_graph_break():
    torch._dynamo.reset()

    def step(param, grad, lr, found_inf):
        ops.fused_sgd_update_(param, grad, lr=lr, found_inf=found_inf, weight_decay=0.1)
        return found_inf + 0

    compiles = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, fullgraph=True, backend=compiles)
    p_eager = torch.randn(1000, dtype=torch.bfloat16)
    p_comp = p_eager.clone()
    g = torch.randn(1000)
    for lr in (0.1, 0.05, 0.01):  # lr in a tensor: new values must not recompile
        lr_t = torch.tensor([lr])
        step(p_eager, g, lr_t, torch.zeros(1))
        compiled(p_comp, g, lr_t, torch.zeros(1))
    assert torch.equal(p_eager, p_comp)
    assert compiles.frame_count == 1


def test_env_var_selects_backend(monkeypatch):
    monkeypatch.setenv(backends.ENV_VAR, "torch")
    assert backends.backend_name(backends.resolve(torch.device("cpu"))) == "torch"
    monkeypatch.setenv(backends.ENV_VAR, "cpp")
    assert backends.backend_name(backends.resolve(torch.device("cpu"))) == "cpp"
    # An explicit argument wins over the environment.
    assert backends.backend_name(backends.resolve(torch.device("cpu"), "torch")) == "torch"


def test_auto_prefers_cpp_on_cpu(monkeypatch):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    assert backends.backend_name(backends.resolve(torch.device("cpu"))) == "cpp"


def test_unknown_backend_is_a_clear_error(monkeypatch):
    with pytest.raises(ValueError, match="unknown lomo_kernels backend 'cuda'"):
        backends.resolve(torch.device("cpu"), "cuda")
    monkeypatch.setenv(backends.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="LOMO_KERNELS_BACKEND"):
        backends.resolve(torch.device("cpu"))


def test_unavailable_backend_warns_once_and_falls_back(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    backends.LOMO.warned.clear()
    backends.LOMO.cache.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = backends.resolve(torch.device("cpu"), "triton")
        second = backends.resolve(torch.device("cpu"), "triton")
    assert backends.backend_name(first) == backends.backend_name(second) == "cpp"
    messages = [str(w.message) for w in caught if "triton" in str(w.message)]
    assert len(messages) == 1 and "TRITON_INTERPRET" in messages[0]


@pytest.mark.parametrize(("given", "name"), [(" Cpp ", "cpp"), ("TORCH", "torch"), ("", "auto")])
def test_backend_names_are_read_as_written_by_hand(monkeypatch, given, name):
    """The variable and the argument are trimmed and case-blind; an empty variable (as
    ``LOMO_KERNELS_BACKEND= make test`` sets it) is automatic."""
    monkeypatch.setenv(backends.ENV_VAR, given)
    assert backends.requested_backend(None) == name
    if given:
        monkeypatch.delenv(backends.ENV_VAR)
        assert backends.requested_backend(given) == name


class _FakeTriton:
    """A Triton backend module that loads (a compiled build's answer)."""

    __name__ = "fake_triton"

    @staticmethod
    def is_available() -> bool:
        return True


def _registry(**importers) -> backends.BackendRegistry:
    reference = {"torch": lambda: backends.LOMO.reference}
    return backends.BackendRegistry("test ", {**reference, **importers})


def test_a_backend_that_cannot_import_falls_back_to_the_reference(monkeypatch):
    """A broken optional dependency never breaks a call: the module's import error is the
    warning's reason and the next backend in line (here the reference) runs."""
    monkeypatch.delenv(backends.ENV_VAR, raising=False)

    def broken():
        raise ImportError("no module named 'broken_extension'")

    registry = _registry(cpp=broken)
    with pytest.warns(RuntimeWarning, match=r"'cpp' unavailable.*import failed.*broken_ext"):
        chosen = registry.resolve(torch.device("cpu"))
    assert chosen is backends.LOMO.reference


def test_a_device_without_kernels_gets_the_reference(monkeypatch):
    """A device type with neither C++ nor Triton kernels (here `meta`) runs the reference,
    automatically and, with a warning naming why, when Triton is asked for."""
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    registry = _registry(triton=lambda: _FakeTriton, cpp=lambda: backends.LOMO.reference)
    assert registry.resolve(torch.device("meta")) is backends.LOMO.reference
    with pytest.warns(RuntimeWarning, match="no Triton kernels for meta tensors"):
        assert registry.resolve(torch.device("meta"), "triton") is backends.LOMO.reference


def test_compiled_triton_serves_cuda_tensors_without_the_interpreter(monkeypatch):
    """TRITON_INTERPRET only decides for CPU tensors: a Triton build that loads serves CUDA
    tensors with or without it, first in CUDA's automatic order."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    registry = _registry(triton=lambda: _FakeTriton, cpp=lambda: backends.LOMO.reference)
    assert registry.load("triton", "cuda") == (_FakeTriton, "")
    assert registry.resolve(torch.device("cuda")) is _FakeTriton
    module, reason = registry.load("triton", "cpu")
    assert module is None and "TRITON_INTERPRET=1" in reason


class _Unavailable:
    """A C++ or Triton backend module that does not load here, counting the questions."""

    def __init__(self, name: str) -> None:
        self.__name__ = f"unavailable_{name}"
        self.asked = 0

    def is_available(self, *device_type: str) -> bool:
        self.asked += 1
        return False

    def unavailable_reason(self, *device_type: str) -> str:
        return f"{self.__name__} is not built"


def test_each_unavailable_backend_is_named_once_and_the_choice_is_kept(monkeypatch):
    """The backend asked for, or automatic's first, is named in a warning when it does not
    load, once per device type however often it is tried again; one further down the order
    falls through silently. A choice is made once per name and device type."""
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    triton, cpp = _Unavailable("triton"), _Unavailable("cpp")
    registry = _registry(triton=lambda: triton, cpp=lambda: cpp)
    cpu = torch.device("cpu")

    def named(resolve) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert resolve() is backends.LOMO.reference
        return [str(w.message).split("'")[1] for w in caught]

    # Triton asked for: named; cpp, tried next, not (it was not asked for).
    assert named(lambda: registry.resolve(cpu, "triton")) == ["triton"]
    assert named(lambda: registry.resolve(cpu, "triton")) == []  # the kept choice
    registry.cache.clear()
    assert named(lambda: registry.resolve(cpu, "triton")) == []  # tried anew, named once
    assert named(lambda: registry.resolve(cpu)) == ["cpp"]  # automatic: cpp first on CPU
    assert triton.asked == 2 and cpp.asked == 3


def test_a_dispatching_block_leaves_no_choice_behind():
    cpu = torch.device("cpu")
    with backends.dispatching_to(cpu, "torch"):
        assert backends.chosen_backend(backends.LOMO) is backends.LOMO.reference
    assert backends.chosen_backend(backends.LOMO) is None


def test_a_module_of_no_backend_has_no_backend_name():
    with pytest.raises(KeyError, match="not a lomo_kernels backend module"):
        backends.backend_name(warnings)


def test_the_fused_heads_kernels_are_triton_on_cuda_where_it_loads(monkeypatch):
    """CPU tensors: blocked torch operations. CUDA tensors: the Triton kernels where Triton
    loads (its answer faked here), else the blocked operations too."""
    from lomo_kernels.kernels.triton import runtime
    from lomo_kernels.ops.cross_entropy import blocked_backend, triton_backend

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for loads in (True, False):
        monkeypatch.setattr(runtime, "is_available", lambda loads=loads: loads)
        assert backends.linear_cross_entropy_kernels(cpu) is blocked_backend
        expected = triton_backend if loads else blocked_backend
        assert backends.linear_cross_entropy_kernels(cuda) is expected


def sparse_csr(dense: torch.Tensor) -> torch.Tensor:
    """`dense` in the CSR layout, without torch's note that the layout is in beta."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta")
        return dense.to_sparse_csr()


BAD_CALLS = {
    "sparse grad": (lambda: (torch.zeros(4, 4), torch.zeros(4, 4).to_sparse(), {}), "sparse"),
    "sparse CSR grad": (
        lambda: (torch.zeros(4, 4), sparse_csr(torch.zeros(4, 4)), {}),
        "sparse",
    ),
    "sparse param": (lambda: (torch.zeros(4, 4).to_sparse(), torch.zeros(4, 4), {}), "dense"),
    "int param": (lambda: (torch.zeros(4, dtype=torch.int32), torch.zeros(4), {}), "int32"),
    "float64 grad": (lambda: (torch.zeros(4), torch.zeros(4, dtype=torch.float64), {}), "float64"),
    "size mismatch": (lambda: (torch.zeros(4), torch.zeros(5), {}), "shape"),
    "non-contiguous param": (lambda: (torch.zeros(4, 4).t(), torch.zeros(4, 4), {}), "contiguous"),
    "negative lr": (lambda: (torch.zeros(4), torch.zeros(4), {"lr": -1.0}), "lr must be >= 0"),
    "nan lr": (lambda: (torch.zeros(4), torch.zeros(4), {"lr": float("nan")}), "finite"),
    # A bool is an int to Python, and math.isfinite("0.1") raises a TypeError of its own.
    "bool lr": (lambda: (torch.zeros(4), torch.zeros(4), {"lr": True}), "lr must be a number"),
    "str clip_value": (
        lambda: (torch.zeros(4), torch.zeros(4), {"clip_value": "2"}),
        "clip_value must be a number",
    ),
    "clip_value 0": (
        lambda: (torch.zeros(4), torch.zeros(4), {"clip_value": 0.0}),
        "clip_value must be > 0",
    ),
    "lr tensor fp64": (
        lambda: (torch.zeros(4), torch.zeros(4), {"lr": torch.tensor([0.1], dtype=torch.float64)}),
        "float32",
    ),
    "found_inf shape": (
        lambda: (torch.zeros(4), torch.zeros(4), {"found_inf": torch.zeros(2)}),
        "1-element",
    ),
    "meta grad": (lambda: (torch.zeros(4), torch.zeros(4, device="meta"), {}), "meta"),
    "seed_step fp32": (
        lambda: (torch.zeros(4), torch.zeros(4), {"seed_step": torch.zeros(1)}),
        "int64",
    ),
    "seed_step shape": (
        lambda: (torch.zeros(4), torch.zeros(4), {"seed_step": torch.zeros(2, dtype=torch.int64)}),
        "1-element",
    ),
}


@pytest.mark.parametrize("case", BAD_CALLS.keys())
def test_bad_input_raises_before_writing(case):
    make, message = BAD_CALLS[case]
    param, grad, kwargs = make()
    kwargs.setdefault("lr", 0.1)
    before = param.clone()
    with pytest.raises((TypeError, ValueError), match=message):
        ops.fused_sgd_update_(param, grad, **kwargs)
    assert torch.equal(param.to_dense(), before.to_dense())  # a sparse param's values too


# The ops that take one data tensor (a gradient, or what they write), each as a call of that
# tensor and the other tensors it writes (an fp32 sum, an 8-bit buffer of 4 elements).
ONE_TENSOR_OPS = {
    "grad_sumsq_": lambda t, out: ops.grad_sumsq_(t, out["sumsq"]),
    "grad_accumulate_int8_": lambda t, out: ops.grad_accumulate_int8_(
        out["codes"], out["scales"], t
    ),
    "int8_dequantize_": lambda t, out: ops.int8_dequantize_(t, out["codes"], out["scales"]),
    "lomo_update_int8_": lambda t, out: ops.lomo_update_int8_(
        t, out["codes"], out["scales"], lr=0.1
    ),
}
BAD_TENSORS = {
    "float64": (lambda: torch.ones(4, dtype=torch.float64), "float64 is not supported"),
    "int32": (lambda: torch.ones(4, dtype=torch.int32), "int32 is not supported"),
    "sparse": (lambda: torch.ones(4).to_sparse(), "sparse"),
}


@pytest.mark.parametrize("bad", BAD_TENSORS)
@pytest.mark.parametrize("op", ONE_TENSOR_OPS)
def test_one_tensor_ops_refuse_what_no_kernel_takes_before_writing(op, bad):
    """A tensor of a dtype no kernel takes, or a sparse one, is refused by name before
    anything is written (the tensor itself where the op writes it, or its sum or buffer)."""
    make, message = BAD_TENSORS[bad]
    tensor = make()
    out = {
        "sumsq": torch.zeros(1),
        "codes": torch.ones(4, dtype=torch.int8),
        "scales": torch.ones(1),
    }
    before = {"tensor": tensor.to_dense().clone(), **{k: v.clone() for k, v in out.items()}}
    with pytest.raises(TypeError, match=message):
        ONE_TENSOR_OPS[op](tensor, out)
    after = {"tensor": tensor.to_dense(), **out}
    assert all(torch.equal(after[k], before[k]) for k in before)


@pytest.mark.parametrize("backend", ["torch", "cpp", "triton"])
@pytest.mark.parametrize("shape", [(6, 4), (24,), (2, 12)], ids=["transposed", "flat", "other"])
def test_gradient_of_another_shape_is_refused_before_any_change(backend, shape):
    """A gradient with the parameter's size but another shape would be applied in memory
    order, to the wrong elements: refused, parameter and AdaLomo state untouched."""
    gen = torch.Generator().manual_seed(0)
    param = torch.randn(4, 6, generator=gen)
    grad = torch.randn(shape, generator=gen)
    before = param.clone()
    with pytest.raises(ValueError, match=r"param has shape \(4, 6\) but grad has shape"):
        ops.fused_sgd_update_(param, grad, lr=0.1, backend=backend)
    state = ops.init_adalomo_state(param)
    saved = {k: v.clone() for k, v in state.items()}
    with pytest.raises(ValueError, match=r"param has shape \(4, 6\) but grad has shape"):
        ops.adalomo_update_(param, grad, state, lr=0.1, beta2=0.9, backend=backend)
    assert torch.equal(param, before)
    assert all(torch.equal(state[k], saved[k]) for k in saved)
