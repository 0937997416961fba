"""AdaLomo's op specs, one per pass (`core/spec.py`): the schema, the fake, the public
conversions and every backend's argument list (csrc/ bindings, Triton launchers, the
reference) come from these."""

from __future__ import annotations

from ...core.spec import GRAD_TRANSFORM, Arg, OpSpec

_GRAD = Arg("grad", "tensor")
_PARAM_WRITTEN = Arg("param", "tensor", mutable=True)
_ROW, _COL = Arg("exp_avg_sq_row", "tensor"), Arg("exp_avg_sq_col", "tensor")
_WORKSPACE = Arg("workspace", "tensor", mutable=True)
_FLAGS = (
    Arg("found_inf", "flag", mutable=True, default=None),
    Arg("skip_if", "flag", default=None),
)
_BETA2 = Arg("beta2", "scalar", rule="unit_interval")
_EPS0 = Arg("eps0", "hyper", rule="non_negative", default=1e-30)
_STEP = (
    Arg("lr", "scalar", rule="non_negative"),
    Arg("eps1", "hyper", rule="non_negative", default=1e-3),
    Arg("clip_threshold", "hyper", rule="positive", default=1.0),
    Arg("weight_decay", "hyper", default=0.0),
)

# Passes A, B and C may take a flat slice of the [rows, cols] matrix the moments describe:
# grad (and param) hold its elements [offset, offset + numel) (a ZeRO-3 or FSDP2 shard, cut
# across rows), summed into (pass A) or read against their rows' and columns' entries; the
# write-back's rms values are the whole matrix's (the workspace holds its sums) and its
# rounding draws the bits of the flat index in it. Last, so positional calls keep their
# meaning.
_SLICE_OFFSET = Arg("offset", "offset", default=0)

FACTORED_STATS = OpSpec(
    "adalomo_factored_stats_",
    "factored_stats_",
    (
        _GRAD,
        Arg("param", "tensor"),
        _WORKSPACE,
        *_FLAGS,
        Arg("cols", "int"),
        *GRAD_TRANSFORM[:2],
        _SLICE_OFFSET,
    ),
)
FACTORED_MOMENTS = OpSpec(
    "adalomo_factored_moments_",
    "factored_moments_",
    (
        Arg("exp_avg_sq_row", "tensor", mutable=True),
        Arg("exp_avg_sq_col", "tensor", mutable=True),
        _WORKSPACE,
        _BETA2,
        GRAD_TRANSFORM[2],
        _EPS0,
    ),
)
FACTORED_NORM = OpSpec(
    "adalomo_factored_norm_",
    "factored_norm_",
    (_GRAD, _ROW, _COL, _WORKSPACE, *GRAD_TRANSFORM, _SLICE_OFFSET),
)
# The write-back's rounding, as the LOMO update's (`lomo.LOMO_UPDATE`).
_ROUNDING = (
    Arg("stochastic_rounding", "bool", default=False),
    Arg("seed", "seed", default=0),
    Arg("seed_step", "step", default=None),
)
FACTORED_APPLY = OpSpec(
    "adalomo_factored_apply_",
    "factored_apply_",
    (
        _PARAM_WRITTEN,
        _GRAD,
        _ROW,
        _COL,
        Arg("workspace", "tensor"),
        *_STEP,
        *GRAD_TRANSFORM,
        *_ROUNDING,
        _SLICE_OFFSET,
    ),
)
VECTOR_STATS = OpSpec(
    "adalomo_vector_stats_",
    "vector_stats_",
    (
        _GRAD,
        Arg("param", "tensor"),
        Arg("exp_avg_sq", "tensor"),
        _WORKSPACE,
        *_FLAGS,
        _BETA2,
        _EPS0,
        *GRAD_TRANSFORM,
    ),
)
VECTOR_APPLY = OpSpec(
    "adalomo_vector_apply_",
    "vector_apply_",
    (
        _PARAM_WRITTEN,
        _GRAD,
        Arg("exp_avg_sq", "tensor", mutable=True),
        Arg("workspace", "tensor"),
        _BETA2,
        _EPS0,
        *_STEP,
        *GRAD_TRANSFORM,
        *_ROUNDING,
        # A 1-D slice: param, grad and v hold elements [offset, offset + numel) of a vector of
        # full_numel elements (its rms values' count); None in the public function: param's.
        _SLICE_OFFSET,
        Arg("full_numel", "count", default=None),
    ),
)
_FACTORED = (FACTORED_STATS, FACTORED_MOMENTS, FACTORED_NORM, FACTORED_APPLY)
_VECTOR = (VECTOR_STATS, VECTOR_APPLY)
SPECS = _FACTORED + _VECTOR
