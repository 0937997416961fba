"""Each fused op is declared once (`lomo_kernels.core.spec`): its schema, and the argument
lists of every backend (the references, the Triton launchers, the C++ and CUDA bindings)
must agree with that declaration, name for name and in order. The public layer's checks and
the choice of backend for dispatcher calls come from it too."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

from lomo_kernels.core.spec import REQUIRED, OpSpec
from lomo_kernels.kernels.cpp.extension import CSRC, EXTENSIONS
from lomo_kernels.ops import adalomo, backends, cross_entropy, embedding_backward, lomo

FAMILIES = {
    "lomo": (backends.LOMO, (lomo.LOMO_UPDATE, lomo.GRAD_SUMSQ)),
    "adalomo": (backends.ADALOMO, adalomo.SPECS),
}
# The C++ binding sources of each family, CPU and CUDA (their arguments: op_bindings.h).
BINDINGS = {
    "lomo": ("lomo_cpu.cpp", "lomo_cuda_binding.cpp"),
    "adalomo": ("adalomo_cpu.cpp", "adalomo_cuda_binding.cpp"),
}
SPECS = [spec for _, specs in FAMILIES.values() for spec in specs]
# A valid public value of each kind of argument (tensors and flags: None passes unchecked).
VALID = {"scalar": 1.0, "hyper": 1.0, "seed": 0, "int": 1, "bool": False}
_DEF = re.compile(r'm\.def\(\s*"(\w+)"\s*,\s*&?\w+\s*,(.*?)\);', re.DOTALL)


def binding_arguments(source: str) -> dict[str, list[str]]:
    """Each function a pybind11 module source defines, with its declared argument names."""
    return {name: re.findall(r'py::arg\("(\w+)"\)', body) for name, body in _DEF.findall(source)}


def test_every_op_is_declared_once():
    """The registered schemas are the specs' (one spec per op of the namespace)."""
    registered = torch.ops.lomo_kernels
    for spec in SPECS:
        schema = getattr(registered, spec.name).default._schema
        assert [a.name for a in schema.arguments] == list(spec.names), spec.name
        written = [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write]
        assert written == list(spec.mutated_names), spec.name
        assert "backend" not in spec.names
    assert len({spec.name for spec in SPECS}) == len(SPECS)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_python_backends_take_the_spec_arguments(family, backend):
    registry, specs = FAMILIES[family]
    module = registry.reference if backend == "torch" else registry.importers[backend]()
    for spec in specs:
        parameters = inspect.signature(getattr(module, spec.function)).parameters
        assert tuple(parameters) == spec.names, (module.__name__, spec.function)


@pytest.mark.parametrize("family", FAMILIES)
def test_cpp_bindings_declare_the_spec_arguments(family):
    """Read from the sources, so the CUDA bindings are checked on any machine: each binding
    source defines its functions through op_bindings.h, whose declarations are the specs'."""
    header = (CSRC / "op_bindings.h").read_text()
    definer = f"def_{family}_ops"
    body = header[header.index(f"void {definer}(") :]
    body = body[: body.index("\n}\n")]
    declared = binding_arguments(body)
    _, specs = FAMILIES[family]
    assert sorted(declared) == sorted(spec.function for spec in specs)
    for spec in specs:
        assert tuple(declared[spec.function]) == spec.names, spec.function
    for source in BINDINGS[family]:
        assert any(source in sources for sources in EXTENSIONS.values())
        text = (CSRC / source).read_text()
        assert f"op_bindings::{definer}(m, " in text and "py::arg" not in text, source


@pytest.mark.parametrize("family", FAMILIES)
def test_built_cpu_extension_takes_the_spec_arguments(family):
    """The extension as built (pybind11's signature line), not only its source."""
    registry, specs = FAMILIES[family]
    extension = registry.importers["cpp"]()._loader.module("cpu")
    for spec in specs:
        doc = getattr(extension, spec.function).__doc__
        names = re.findall(r"(\w+): ", doc.splitlines()[0])
        assert tuple(names) == spec.names, spec.function


# Each op's public function (the one that runs that op alone).
PUBLIC = {
    lomo.LOMO_UPDATE: lomo.fused_lomo_update_,
    lomo.GRAD_SUMSQ: lomo.grad_sumsq_,
    adalomo.FACTORED_STATS: adalomo.adalomo_factored_stats_,
    adalomo.FACTORED_MOMENTS: adalomo.adalomo_factored_moments_,
    adalomo.FACTORED_NORM: adalomo.adalomo_factored_norm_,
    adalomo.FACTORED_APPLY: adalomo.adalomo_factored_apply_,
    adalomo.VECTOR_STATS: adalomo.adalomo_vector_stats_,
    adalomo.VECTOR_APPLY: adalomo.adalomo_vector_apply_,
}


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_public_functions_take_the_spec_arguments_and_defaults(spec: OpSpec):
    """Every argument of the op is a parameter of its public function (but a shape the
    function reads off a tensor), with the spec's default; and `backend=` besides."""
    parameters = inspect.signature(PUBLIC[spec]).parameters
    assert set(parameters) - set(spec.names) == {"backend"}
    for arg in spec.args:
        if arg.kind == "int":
            assert arg.name not in parameters
            continue
        default = parameters[arg.name].default
        expected = inspect.Parameter.empty if arg.default is REQUIRED else arg.default
        assert default == expected, (spec.name, arg.name)


def test_a_binding_that_disagrees_is_caught():
    """The comparison above fails on a binding whose arguments are swapped or missing."""
    spec = lomo.GRAD_SUMSQ
    swapped = 'm.def("grad_sumsq_", &f, py::arg("grad"), py::arg("sumsq"),\n'
    swapped += '      py::arg("inv_scale"), py::arg("found_inf"));'
    missing = 'm.def("grad_sumsq_", &f, "doc", py::arg("grad"), py::arg("inv_scale"));'
    for source in (swapped, missing):
        assert tuple(binding_arguments(source)["grad_sumsq_"]) != spec.names


def test_schema_is_derived_from_the_spec():
    assert lomo.GRAD_SUMSQ.schema() == (
        "(Tensor grad, Tensor? inv_scale, Tensor(a2!) sumsq, Tensor(a3!)? found_inf) -> ()"
    )


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_public_conversion_refuses_bad_values_by_name(spec: OpSpec):
    """Every runtime scalar and hyper-parameter of every op is checked by its spec before the
    op runs: a non-finite value is refused with an error naming the argument."""
    device = torch.device("cpu")
    checked = [a for a in spec.args if a.kind in ("scalar", "factor", "hyper", "clip")]
    assert checked
    for arg in checked:
        values = {a.name: VALID.get(a.kind) for a in spec.args}
        values[arg.name] = float("nan")
        with pytest.raises(ValueError, match=rf"{arg.name} must be finite"):
            spec.convert(device, values)


def test_dispatcher_calls_run_the_chosen_backend(monkeypatch):
    """A call through the dispatcher runs the backend chosen for it, else the device's."""
    calls = []
    reference = backends.LOMO.reference
    original = reference.grad_sumsq_
    monkeypatch.setattr(
        reference, "grad_sumsq_", lambda **kwargs: (calls.append(kwargs), original(**kwargs))
    )
    grad, sumsq = torch.ones(10), torch.zeros(1)
    op = torch.ops.lomo_kernels.grad_sumsq_.default
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    op(grad, None, sumsq, None)  # the CPU default: C++
    assert calls == [] and sumsq.item() == 10.0
    with backends.dispatching_to(torch.device("cpu"), "torch"):
        op(grad, None, sumsq, None)
    assert [list(c) for c in calls] == [list(lomo.GRAD_SUMSQ.names)]
    assert sumsq.item() == 20.0


def test_sources_named_in_the_loader_exist():
    for sources in EXTENSIONS.values():
        for source in sources:
            assert Path(CSRC, source).is_file(), source


# The ops that return tensors (the fused loss, the opaque embedding backward); their bodies
# and every backend's forward take the spec's arguments (the loss's backward kernels work per
# vocabulary chunk, under the body).
RETURNING_SPECS = (cross_entropy.FORWARD, cross_entropy.BACKWARD, embedding_backward.DENSE_BACKWARD)


def test_ops_returning_tensors_are_declared_once():
    registered = torch.ops.lomo_kernels
    for spec in RETURNING_SPECS:
        schema = getattr(registered, spec.name).default._schema
        assert [a.name for a in schema.arguments] == list(spec.names), spec.name
        assert [r.name for r in schema.returns] == list(spec.returns), spec.name
        assert not any(a.alias_info for a in schema.arguments), spec.name
    assert cross_entropy.FORWARD.schema() == (
        "(Tensor hidden, Tensor weight, Tensor labels, int ignore_index) "
        "-> (Tensor loss, Tensor lse)"
    )


@pytest.mark.parametrize("module", ["reference", "blocked", "triton"])
def test_fused_loss_backends_take_the_forward_spec_arguments(module):
    from lomo_kernels.kernels.blocked import linear_cross_entropy as blocked
    from lomo_kernels.kernels.triton import linear_cross_entropy as triton
    from lomo_kernels.ops import cross_entropy_reference as reference

    chosen = {"reference": reference, "blocked": blocked, "triton": triton}[module]
    parameters = inspect.signature(chosen.forward).parameters
    assert tuple(parameters) == cross_entropy.FORWARD.names


def test_a_body_that_disagrees_with_its_spec_is_refused():
    def body(hidden, labels, weight, ignore_index):  # two arguments swapped
        raise AssertionError("never run")

    with pytest.raises(TypeError, match="linear_cross_entropy_forward"):
        backends.define_returning(cross_entropy.FORWARD, body, body)


def test_every_op_of_the_namespace_has_its_spec():
    ops = torch.ops.lomo_kernels
    registered = {name for name in dir(ops) if not name.startswith("_") and name != "name"}
    assert registered == {spec.name for spec in SPECS + list(RETURNING_SPECS)}


@pytest.mark.parametrize("clip_grad_norm", [None, 1.0])
def test_lomo_runs_the_update_public_checks_once_per_step(clip_grad_norm):
    """Lomo's per-tensor calls skip the public function's conversions; the spec's checks run
    on the step's values once per step instead: a value not in the op's form (here its clip
    coefficient holding two elements) is refused by name before any parameter changes."""
    from lomo_kernels import Lomo

    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    opt = Lomo(model, lr=0.1, clip_grad_norm=clip_grad_norm)
    x = torch.randn(4, 6)
    opt.fused_backward(model(x).square().mean())  # a good step
    before = [p.detach().clone() for p in model.parameters()]
    opt._scalars[torch.device("cpu")].clip_coef = torch.ones(2)
    with pytest.raises(ValueError, match="clip_coef must be a 1-element"):
        opt.fused_backward(model(x).square().mean())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
