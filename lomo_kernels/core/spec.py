"""One description per fused op: its name and its arguments (kind, mutability).

Everything else about an op's arguments is derived from its `OpSpec`:

  - the `torch.library` schema (`OpSpec.schema`) and its mutation annotations,
  - the eager fast path's view of the op: which arguments are tensors, which it writes,
  - the public function's conversion and checks of every runtime scalar, flag and
    hyper-parameter (`OpSpec.convert`), before anything is written,
  - the keyword arguments every backend function receives: the reference, the Triton
    launchers and the C++/CUDA bindings take exactly these names in this order
    (tests/ops/test_op_specs.py compares each backend's declared arguments with the spec).

An argument's kind says what it is to the kernels and how a public call may give it:

    tensor   a dense tensor the op reads or writes (param, grad, moments, workspace)
    scalar   a runtime scalar: a 1-element fp32 device tensor (a Python float is converted)
    factor   an optional multiplier, as `scalar`; absent or exactly 1 means None
    flag     an optional 1-element fp32 device tensor (found_inf, skip_if, sumsq)
    step     an optional 1-element int64 device tensor (the rounding seed's per-step part)
    hyper    a Python float fixed for a run (weight decay, eps, clip threshold)
    clip     an optional Python float > 0 (clip by value; None: no clipping)
    seed     a Python int in [0, 2**63)
    int      a Python int (a shape)
    offset   a Python int >= 0 a call gives: a slice's flat offset in its parameter
    count    a Python int >= 0 a call gives: the element count of the parameter a slice is of
    const    a Python int a compiled graph specialises on (a label to ignore, a row count)
    bool     a Python bool
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .checks import check_finite, check_scalar_tensor
from .scalars import device_scalar, optional_factor

_SCHEMA_TYPES = {
    "tensor": "Tensor",
    "scalar": "Tensor",
    "factor": "Tensor?",
    "flag": "Tensor?",
    "step": "Tensor?",
    "hyper": "float",
    "clip": "float?",
    "seed": "SymInt",
    "int": "SymInt",
    "offset": "SymInt",
    "count": "SymInt",
    "const": "int",
    "bool": "bool",
}
_TENSOR_KINDS = ("tensor", "scalar", "factor", "flag", "step")


# The default of an argument a public call must give.
REQUIRED = object()


@dataclass(frozen=True)
class Arg:
    """One argument of an op. `rule` restricts a scalar or hyper-parameter:
    'non_negative', 'positive' or 'unit_interval'. `required`: a flag that must be given.
    `default`: the public functions' default (tests/ops/test_op_specs.py checks each)."""

    name: str
    kind: str
    mutable: bool = False
    rule: str = ""
    required: bool = False
    default: Any = REQUIRED

    def __post_init__(self) -> None:
        if self.kind not in _SCHEMA_TYPES:
            raise ValueError(f"unknown argument kind {self.kind!r} of {self.name!r}")

    @property
    def is_tensor(self) -> bool:
        return self.kind in _TENSOR_KINDS

    def schema_type(self) -> str:
        if self.kind == "flag" and self.required:
            return "Tensor"
        return _SCHEMA_TYPES[self.kind]

    def converter(self) -> Callable[[Any, torch.device], Any] | None:
        """The public layer's conversion of a value given for this argument (None: passed
        as given, e.g. a tensor whose shape the op's own checks look at)."""
        name, rule = self.name, self.rule
        if self.kind == "scalar":
            non_negative, unit = rule == "non_negative", rule == "unit_interval"
            return lambda v, device: (
                v
                if _device_scalar_already(v, device)
                else device_scalar(name, v, device, non_negative=non_negative, unit_interval=unit)
            )
        if self.kind == "factor":
            return lambda v, device: (
                v if _device_scalar_already(v, device) else optional_factor(name, v, device)
            )
        if self.kind == "flag":
            required = self.required
            return lambda v, device: (
                v
                if (v is None and not required) or _device_scalar_already(v, device)
                else _flag(name, v, device, required)
            )
        if self.kind == "step":
            return lambda v, device: _flag(name, v, device, False, torch.int64)
        if self.kind == "hyper":
            positive, non_negative = rule == "positive", rule == "non_negative"
            return lambda v, device: _hyper(name, v, positive, non_negative)
        if self.kind == "clip":
            return lambda v, device: None if v is None else _hyper(name, v, True, False)
        if self.kind == "seed":
            return lambda v, device: _seed(v)
        if self.kind == "bool":
            return lambda v, device: bool(v)
        if self.kind in ("int", "const"):
            return lambda v, device: int(v)
        if self.kind in ("offset", "count"):  # an element index, or a number of elements
            return lambda v, device: _offset(name, v)
        return None


def _device_scalar_already(value: Any, device: torch.device) -> bool:
    """True for what the ops take as it is: a 1-element fp32 tensor on `device` (the common
    case, tested first and at once: optimizers make several such calls per parameter)."""
    return (
        type(value) is torch.Tensor
        and value.dtype is torch.float32
        and value.device == device
        and value.numel() == 1
    )


def _flag(
    name: str, value: Any, device: torch.device, required: bool, dtype: torch.dtype = torch.float32
) -> torch.Tensor | None:
    if value is None and required:
        raise TypeError(f"lomo_kernels: {name} is required (a 1-element fp32 device tensor)")
    check_scalar_tensor(name, value, device, dtype=dtype)
    return value


def _hyper(name: str, value: Any, positive: bool, non_negative: bool) -> float:
    check_finite(name, value, positive=positive, non_negative=non_negative)
    return float(value)


def _offset(name: str, value: Any) -> int:
    # A flat element index, which every backend holds in 64 bits.
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
        raise ValueError(f"lomo_kernels: {name} must be an int in [0, 2**63), got {value!r}")
    return value


def _seed(value: Any) -> int:
    seed = int(value)
    if not 0 <= seed < 2**63:
        raise ValueError(f"lomo_kernels: seed must be in [0, 2**63), got {seed}")
    return seed


@dataclass(frozen=True)
class OpSpec:
    """A fused op: ``lomo_kernels::<name>``; `function`: the name of the backend functions
    that run it (the same in every backend module of its family)."""

    name: str
    function: str
    args: tuple[Arg, ...]
    # Names of the tensors the op returns (none: it only writes into its arguments).
    returns: tuple[str, ...] = ()
    # Derived from `args` (below): the public checks, and the argument names in the op's order.
    plan: tuple[tuple[str, Callable[[Any, torch.device], Any] | None], ...] = field(
        init=False, repr=False, compare=False
    )
    names: tuple[str, ...] = field(init=False, repr=False, compare=False)
    tensor_names: tuple[str, ...] = field(init=False, repr=False, compare=False)
    mutated_names: tuple[str, ...] = field(init=False, repr=False, compare=False)
    # The op's arguments as one value, by position or name: what a backend that builds its
    # launch in Python takes, instead of restating the argument list.
    Arguments: type = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Built once: a public call only reads them (and traced code reads no cache).
        derived = {
            "plan": self.converters(),
            "names": tuple(a.name for a in self.args),
            "tensor_names": tuple(a.name for a in self.args if a.is_tensor),
            "mutated_names": tuple(a.name for a in self.args if a.mutable),
            "Arguments": namedtuple(
                f"{self.name.strip('_')}_arguments", [a.name for a in self.args]
            ),
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    @property
    def qualname(self) -> str:
        return f"lomo_kernels::{self.name}"

    def schema(self) -> str:
        """The `torch.library` schema: ``(Tensor(a0!) param, Tensor grad, ...) -> ()``, or
        ``-> (Tensor loss, Tensor lse)`` for an op returning tensors."""
        parts = []
        for index, arg in enumerate(self.args):
            type_ = arg.schema_type()
            if arg.mutable:
                optional = type_.endswith("?")
                type_ = f"{type_.rstrip('?')}(a{index}!)" + ("?" if optional else "")
            parts.append(f"{type_} {arg.name}")
        returned = ", ".join(f"Tensor {name}" for name in self.returns)
        return f"({', '.join(parts)}) -> ({returned})"

    def converters(self) -> tuple[tuple[str, Callable[[Any, torch.device], Any] | None], ...]:
        return tuple((a.name, a.converter()) for a in self.args)

    def convert(self, device: torch.device, values: dict[str, Any]) -> dict[str, Any]:
        """`values` (every argument by name, as a public call gives them) checked and
        converted for the op, in the op's argument order; raises before anything runs."""
        converted = {}
        for name, convert in self.plan:
            value = values[name]
            converted[name] = value if convert is None else convert(value, device)
        return converted

    def take(self, public: dict[str, Any], **derived: Any) -> dict[str, Any]:
        """This op's arguments by name out of `derived`, else `public` (a public function's
        arguments, ``locals()`` on entry), in the op's order."""
        return {name: derived[name] if name in derived else public[name] for name in self.names}

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """Positional and keyword arguments of a call of the op, by name."""
        bound = dict(zip(self.names, args, strict=False))
        bound.update(kwargs)
        return bound


# The gradient transform every op that reads a gradient takes, in this order:
# ``clamp(grad * inv_scale, +-clip_value) * clip_coef``.
GRAD_TRANSFORM = (
    Arg("inv_scale", "factor", default=1.0),
    Arg("clip_value", "clip", default=None),
    Arg("clip_coef", "factor", default=None),
)


class Conversion:
    """The checks and conversions of the arguments of several ops one public function runs
    (each argument once, all before the first op writes)."""

    def __init__(self, *specs: OpSpec) -> None:
        self.specs = specs
        self.plan = {name: convert for spec in specs for name, convert in spec.plan}

    def convert(self, device: torch.device, values: dict[str, Any]) -> dict[str, Any]:
        """`values` (arguments of these ops, by name) checked and converted."""
        converted = {}
        for name, value in values.items():
            convert = self.plan[name]
            converted[name] = value if convert is None else convert(value, device)
        return converted
