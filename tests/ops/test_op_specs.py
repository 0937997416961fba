"""Each fused op is declared once (`lomo_kernels.core.spec`): its schema, and the argument
lists of every backend (the references, the Triton launchers, the C++ and CUDA bindings)
must agree with that declaration, name for name and in order. The public layer's checks and
the choice of backend for dispatcher calls come from it too."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from lomo_kernels.core.spec import REQUIRED, Arg, OpSpec
from lomo_kernels.kernels.cpp.extension import CSRC, EXTENSIONS
from lomo_kernels.ops import adalomo, backends, cross_entropy, definition, lomo
from lomo_kernels.ops import embedding as embedding_backward

FAMILIES = {
    "lomo": (backends.LOMO, lomo.SPECS),
    "adalomo": (backends.ADALOMO, adalomo.SPECS),
}
# The C++ binding sources of each family, CPU and CUDA (their arguments: op_bindings.h).
BINDINGS = {
    "lomo": ("lomo_cpu.cpp", "lomo_cuda_binding.cpp"),
    "adalomo": ("adalomo_cpu.cpp", "adalomo_cuda_binding.cpp"),
}
SPECS = [spec for _, specs in FAMILIES.values() for spec in specs]
# A valid public value of each kind of argument (tensors and flags: None passes unchecked).
VALID = {"scalar": 1.0, "hyper": 1.0, "seed": 0, "int": 1, "offset": 0, "count": 1, "bool": False}


def valid_values(spec: OpSpec) -> dict[str, Any]:
    """A valid value of each of `spec`'s non-tensor arguments (None for tensors), a required
    flag given: the call a test then changes one argument of."""
    return {a.name: torch.zeros(1) if a.required else VALID.get(a.kind) for a in spec.args}


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
def test_cuda_bindings_share_the_cpu_declarations(family):
    """The CUDA bindings cannot be built here: every binding source, CPU and CUDA, is part of
    an extension and defines its functions through op_bindings.h's definer alone, so the
    arguments the built CPU extension shows (below) are the CUDA bindings' too."""
    definer = f"def_{family}_ops"
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
    lomo.GRAD_ACCUMULATE: lomo.grad_accumulate_,
    lomo.GRAD_ACCUMULATE_INT8: lomo.grad_accumulate_int8_,
    lomo.LOMO_UPDATE_INT8: lomo.lomo_update_int8_,
    lomo.INT8_DEQUANTIZE: lomo.int8_dequantize_,
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
    function reads off a tensor), with the spec's default; and `backend=` besides (and pass
    A's `full_shape`, the shape of the parameter a 1-D slice is of, which no tensor holds)."""
    parameters = inspect.signature(PUBLIC[spec]).parameters
    shapes = {"full_shape"} if spec is adalomo.FACTORED_STATS else set()
    assert set(parameters) - set(spec.names) == {"backend"} | shapes
    for arg in spec.args:
        if arg.kind == "int":
            assert arg.name not in parameters
            continue
        default = parameters[arg.name].default
        expected = inspect.Parameter.empty if arg.default is REQUIRED else arg.default
        assert default == expected, (spec.name, arg.name)


@pytest.mark.parametrize("family", FAMILIES)
def test_built_cpu_extension_defines_the_spec_functions_only(family):
    """The built extension binds one function per op of the family (pybind11 functions
    carry a signature line), none missing, none besides."""
    registry, specs = FAMILIES[family]
    extension = registry.importers["cpp"]()._loader.module("cpu")
    bound = {
        name
        for name in dir(extension)
        if not name.startswith("_") and inspect.isbuiltin(getattr(extension, name))
    }
    assert bound == {spec.function for spec in specs}


# The argument kinds a call may leave out (None), unless the spec requires them.
OPTIONAL_KINDS = ("factor", "flag", "step", "clip")


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_schema_is_derived_from_the_spec(spec: OpSpec):
    """The schema as torch parses it: the spec's arguments in order, tensors where the
    kernels take tensors, Optional exactly where a call may pass None, written exactly where
    the op mutates, nothing returned."""
    parsed = torch._C.parse_schema(f"lomo_kernels::{spec.name}{spec.schema()}")
    for got, arg in zip(parsed.arguments, spec.args, strict=True):
        assert got.name == arg.name
        optional = isinstance(got.type, torch.OptionalType)
        assert optional == (arg.kind in OPTIONAL_KINDS and not arg.required), arg.name
        element = got.type.getElementType() if optional else got.type
        assert isinstance(element, torch.TensorType) == arg.is_tensor, arg.name
        assert bool(got.alias_info and got.alias_info.is_write) == arg.mutable, arg.name
    assert parsed.returns == []


# The kinds of runtime scalars and hyper-parameters, and the ops that take any.
SCALAR_KINDS = ("scalar", "factor", "hyper", "clip")
WITH_SCALARS = [s for s in SPECS if any(a.kind in SCALAR_KINDS for a in s.args)]


@pytest.mark.parametrize("spec", WITH_SCALARS, ids=lambda s: s.name)
def test_public_conversion_refuses_bad_values_by_name(spec: OpSpec):
    """Every runtime scalar and hyper-parameter of every op is checked by its spec before the
    op runs: a non-finite value is refused with an error naming the argument."""
    device = torch.device("cpu")
    checked = [a for a in spec.args if a.kind in SCALAR_KINDS]
    for arg in checked:
        values = valid_values(spec)
        values[arg.name] = float("nan")
        with pytest.raises(ValueError, match=rf"{arg.name} must be finite"):
            spec.convert(device, values)


# Each rule's edge values accepted, and the nearest values outside it refused (as floats:
# a device tensor's value is not read).
RULE_EDGES = {
    "non_negative": ([0.0, 5.0], [-1e-30], "must be"),
    "positive": ([1e-30, 5.0], [0.0, -1.0], "must be"),
    "unit_interval": ([0.0, 1.0], [-1e-30, 1.0000001], r"must be in \[0, 1\]"),
}
RULED = [(s, a) for s in SPECS for a in s.args if a.rule and a.kind in ("scalar", "hyper")]


@pytest.mark.parametrize(("spec", "arg"), RULED, ids=lambda x: x.name)
def test_each_argument_rule_holds_at_its_edges(spec: OpSpec, arg):
    """beta2 is 0 at AdaLomo's first step (1 - 1**decay_rate) and 1 where the moments stop;
    a loss scale's inverse or a learning rate of 0 is valid: every rule takes its edges and
    refuses, by the argument's name, what lies past them."""
    accepted, refused, message = RULE_EDGES[arg.rule]
    device = torch.device("cpu")
    values = valid_values(spec)
    for value in accepted:
        converted = spec.convert(device, {**values, arg.name: value})[arg.name]
        assert float(converted) == value, (arg.name, value)
    for value in refused:
        with pytest.raises(ValueError, match=rf"{arg.name} {message}"):
            spec.convert(device, {**values, arg.name: value})


@pytest.mark.parametrize("bad", [-1, 2.0, True, None, 2**63])
def test_offsets_are_refused_unless_a_non_negative_int(bad):
    """The 8-bit buffer's ops, the dense update and accumulation, and AdaLomo's factored
    passes take a slice's flat offset, an int64 element index: refused by name
    otherwise (2**63 overflowed the torch and C++ backends, and Triton ran it)."""
    with_offset = [s for s in SPECS if any(a.kind == "offset" for a in s.args)]
    assert len(with_offset) == 9
    for spec in with_offset:
        values = valid_values(spec)
        values["offset"] = bad
        with pytest.raises(ValueError, match=r"offset must be an int in \[0, 2\*\*63\)"):
            spec.convert(torch.device("cpu"), values)


def test_an_8_bit_buffer_s_flat_indices_must_be_int64s():
    """The spec checks the first element's flat index; a buffer's last one and its end
    (offset + numel, which the backends index too) must be int64s as well: refused by the
    op's checks before any backend runs, the largest fitting offset taken."""
    from lomo_kernels import ops
    from lomo_kernels.core.int8_blocks import blocks_of

    grad = torch.ones(2)
    for offset, fits in ((2**63 - 3, True), (2**63 - 2, False), (2**63 - 1, False)):
        codes, scales = torch.zeros(2, dtype=torch.int8), torch.zeros(blocks_of(offset, 2))
        if fits:
            ops.grad_accumulate_int8_(codes, scales, grad, offset=offset, first=True,
                                      backend="torch")  # fmt: skip
            assert torch.equal(codes.float() * scales[-1], grad)  # stored: the op ran
            continue
        with pytest.raises(ValueError, match=r"end past 2\*\*63 - 1"):
            ops.grad_accumulate_int8_(codes, scales, grad, offset=offset, first=True)


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
        "(Tensor hidden, Tensor weight, Tensor labels, int ignore_index, float temperature) "
        "-> (Tensor loss, Tensor lse)"
    )


@pytest.mark.parametrize("module", ["reference", "blocked", "triton"])
def test_fused_loss_backends_take_the_forward_spec_arguments(module):
    from lomo_kernels.ops.cross_entropy import blocked_backend as blocked
    from lomo_kernels.ops.cross_entropy import reference as reference
    from lomo_kernels.ops.cross_entropy import triton_backend as triton

    chosen = {"reference": reference, "blocked": blocked, "triton": triton}[module]
    parameters = inspect.signature(chosen.forward).parameters
    assert tuple(parameters) == cross_entropy.FORWARD.names


def test_a_body_that_disagrees_with_its_spec_is_refused():
    def body(hidden, labels, weight, ignore_index):  # two arguments swapped
        raise AssertionError("never run")

    with pytest.raises(TypeError, match="linear_cross_entropy_forward"):
        definition.define_returning(cross_entropy.FORWARD, body, body)


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


def test_converted_floats_are_reused_and_their_cache_stays_bounded():
    """A float converts to one device tensor per value, reused by later calls (one fill, not
    one per call); a schedule making a new value every step does not grow the cache past
    its bound."""
    from lomo_kernels.core import scalars

    device = torch.device("cpu")
    first = scalars.device_scalar("lr", 0.125, device)
    assert scalars.device_scalar("lr", 0.125, device) is first
    for step in range(3 * scalars._CACHE_LIMIT):
        scalars.device_scalar("lr", 1e-3 * (1 + step), device)
        assert len(scalars._CACHE) <= scalars._CACHE_LIMIT


def test_an_argument_of_an_unknown_kind_is_refused_where_it_is_declared():
    with pytest.raises(ValueError, match="unknown argument kind 'scaler' of 'lr'"):
        Arg("lr", "scaler")


def _kind_cases(arg: Arg) -> tuple[list[tuple[Any, Any]], list[tuple[Any, type, str]]]:
    """(given, converted) pairs accepted for `arg`, and (given, error, message) refused."""
    cpu, name = torch.device("cpu"), arg.name
    other_device = torch.ones(1, device="meta")
    if arg.kind == "flag":
        flag = torch.zeros(1)
        missing = [(None, TypeError, f"{name} is required")] if arg.required else []
        return [(flag, flag)] + ([] if arg.required else [(None, None)]), [
            *missing,
            (True, TypeError, f"{name} must be a torch.Tensor"),
            (torch.zeros(2), ValueError, f"{name} must be a 1-element float32"),
            (other_device, ValueError, f"{name} is on meta but the parameter is on {cpu}"),
        ]
    if arg.kind == "step":
        step = torch.zeros(1, dtype=torch.int64)
        return [(step, step), (None, None)], [
            (torch.zeros(1), ValueError, f"{name} must be a 1-element int64"),
        ]
    if arg.kind == "clip":
        return [(None, None), (0.5, 0.5)], [(0.0, ValueError, f"{name} must be")]
    if arg.kind == "seed":
        return [(7, 7), (2**63 - 1, 2**63 - 1)], [
            (2**63, ValueError, r"seed must be in \[0, 2\*\*63\)"),
            (-1, ValueError, r"seed must be in \[0, 2\*\*63\)"),
        ]
    if arg.kind == "bool":
        return [(1, True), (0, False)], []
    if arg.kind == "int":
        return [(3.0, 3)], []
    if arg.kind in ("scalar", "factor"):
        return [], [(other_device, ValueError, f"{name} is on meta but the parameter is on")]
    return [], []


CONVERTED = [(s, a) for s in SPECS for a in s.args if any(_kind_cases(a))]


@pytest.mark.parametrize(("spec", "arg"), CONVERTED, ids=lambda x: x.name)
def test_each_argument_kind_is_converted_or_refused_by_name(spec: OpSpec, arg: Arg):
    """Flags and steps are 1-element device tensors of their dtype on the parameter's device
    (a required one must be given), a clip value is positive, a seed a 64-bit int >= 0, bools
    and ints are converted; a scalar on another device is refused, not copied."""
    accepted, refused = _kind_cases(arg)
    values = valid_values(spec)
    for given, expected in accepted:
        converted = spec.convert(torch.device("cpu"), {**values, arg.name: given})[arg.name]
        assert converted is expected or (
            converted == expected and type(converted) is type(expected)
        )
    for given, error, message in refused:
        with pytest.raises(error, match=message):
            spec.convert(torch.device("cpu"), {**values, arg.name: given})


def test_a_call_binds_positional_and_keyword_arguments_by_name():
    """A call of an op may give its first arguments by position and the rest by name (as the
    dispatcher and torch.library pass them)."""
    spec = SPECS[0]
    first, *rest = spec.names
    bound = spec.bind(("p",), {name: name.upper() for name in rest})
    assert bound == {first: "p", **{name: name.upper() for name in rest}}
    assert spec.bind(tuple(spec.names), {}) == dict(zip(spec.names, spec.names, strict=True))
