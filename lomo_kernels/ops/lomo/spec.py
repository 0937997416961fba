"""The LOMO ops' specs, one per op (`core/spec.py`): the schema, the fake, the public
conversions and every backend's argument list come from these."""

from __future__ import annotations

from ...core.spec import GRAD_TRANSFORM, Arg, OpSpec

# The flat index of a dense tensor's element 0 in the parameter it is a slice of (a ZeRO-3 or
# FSDP2 shard, a block of rows): stochastic rounding draws the bits of index offset + j, so a
# slice rounds as the whole parameter would, in one call. Last, so positional calls keep
# their meaning.
_SLICE_OFFSET = Arg("offset", "offset", default=0)
LOMO_UPDATE = OpSpec(
    "lomo_update_",
    "lomo_update_",
    (
        Arg("param", "tensor", mutable=True),
        Arg("grad", "tensor"),
        Arg("lr", "scalar", rule="non_negative"),
        *GRAD_TRANSFORM,
        Arg("weight_decay", "hyper", default=0.0),
        Arg("found_inf", "flag", mutable=True, default=None),
        Arg("skip_if", "flag", default=None),
        Arg("stochastic_rounding", "bool", default=False),
        Arg("seed", "seed", default=0),
        Arg("seed_step", "step", default=None),
        _SLICE_OFFSET,
    ),
)
GRAD_SUMSQ = OpSpec(
    "grad_sumsq_",
    "grad_sumsq_",
    (
        Arg("grad", "tensor"),
        GRAD_TRANSFORM[0],
        Arg("sumsq", "flag", mutable=True, required=True),
        Arg("found_inf", "flag", mutable=True, default=None),
    ),
)
GRAD_ACCUMULATE = OpSpec(
    "grad_accumulate_",
    "grad_accumulate_",
    (
        Arg("buffer", "tensor", mutable=True),
        Arg("grad", "tensor"),
        Arg("first", "bool", default=False),
        Arg("inv_scale", "factor", default=1.0),
        Arg("sumsq", "flag", mutable=True, default=None),
        Arg("found_inf", "flag", mutable=True, default=None),
        Arg("stochastic_rounding", "bool", default=False),
        Arg("seed", "seed", default=0),
        Arg("seed_step", "step", default=None),
        _SLICE_OFFSET,
    ),
)
# The 8-bit blockwise buffer (`core/int8_blocks.py`): int8 codes, one fp32 scale per block of
# the parameter's flat index; `offset` is the flat offset of codes[0] in its parameter (the
# block edges and the rounding bits follow it).
GRAD_ACCUMULATE_INT8 = OpSpec(
    "grad_accumulate_int8_",
    "grad_accumulate_int8_",
    (
        Arg("codes", "tensor", mutable=True),
        Arg("scales", "tensor", mutable=True),
        Arg("grad", "tensor"),
        Arg("offset", "offset", default=0),
        Arg("first", "bool", default=False),
        Arg("inv_scale", "factor", default=1.0),
        Arg("sumsq", "flag", mutable=True, default=None),
        Arg("found_inf", "flag", mutable=True, default=None),
        Arg("stochastic_rounding", "bool", default=False),
        Arg("seed", "seed", default=0),
        Arg("seed_step", "step", default=None),
    ),
)
LOMO_UPDATE_INT8 = OpSpec(
    "lomo_update_int8_",
    "lomo_update_int8_",
    (
        Arg("param", "tensor", mutable=True),
        Arg("codes", "tensor"),
        Arg("scales", "tensor"),
        Arg("offset", "offset", default=0),
        Arg("lr", "scalar", rule="non_negative"),
        *GRAD_TRANSFORM,
        Arg("weight_decay", "hyper", default=0.0),
        Arg("found_inf", "flag", mutable=True, default=None),
        Arg("skip_if", "flag", default=None),
        Arg("stochastic_rounding", "bool", default=False),
        Arg("seed", "seed", default=0),
        Arg("seed_step", "step", default=None),
    ),
)
INT8_DEQUANTIZE = OpSpec(
    "int8_dequantize_",
    "int8_dequantize_",
    (
        Arg("out", "tensor", mutable=True),
        Arg("codes", "tensor"),
        Arg("scales", "tensor"),
        Arg("offset", "offset", default=0),
    ),
)

SPECS = (
    LOMO_UPDATE,
    GRAD_SUMSQ,
    GRAD_ACCUMULATE,
    GRAD_ACCUMULATE_INT8,
    LOMO_UPDATE_INT8,
    INT8_DEQUANTIZE,
)
