"""The fused AdaLomo passes: their schemas (torch.library), public functions, and the
per-parameter step built from them.

AdaLomo is Adafactor without a first moment (see `adalomo_update_` for the math). One step
of one parameter runs as a few fused passes; each pass is one op, one kernel launch:

    >= 2 dims, viewed as [rows, cols = shape[-1]]:
      adalomo_factored_stats_    pass A: reads grad + param; row/column sums of g^2 before
                                 the clip coefficient, sum (grad*inv_scale)^2, sum p^2,
                                 non-finite flag
      adalomo_factored_moments_  the row/column moments R, C (vectors; the clip coefficient
                                 and eps0 applied to the means) and sum(R)
      adalomo_factored_norm_     pass B: reads grad; sum of update^2
      adalomo_factored_apply_    pass C: reads grad + param, writes param
    1-D:
      adalomo_vector_stats_      pass A1: reads grad, param, v; sum of update^2, sum p^2
      adalomo_vector_apply_      pass C1: reads grad, param, v; writes param and v

Every pass accumulates into, or reads from, one zeroed fp32 workspace per parameter and step
(`workspace.py`). Because pass A measures the gradient's sum of squares before
anything uses the clip coefficient, a caller may compute that coefficient from it between
pass A and the moments (`adalomo_update_`'s ``on_grad_sumsq``). The public functions accept
the runtime scalars (lr, beta2, inv_scale, clip_coef) as Python floats or 1-element fp32
device tensors and convert them once (`scalars.py`); the ops take tensors only, and nothing
reads a device value on the host, so a step never synchronises. Kernels per device: `backends.py`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch

from ...core.checks import check_pair
from ...core.rounding import check_stochastic_rounding
from ...core.scalars import Scalar
from ...core.spec import Conversion
from ..backends import ADALOMO
from ..definition import define
from ..eager import FusedOp, FusedSequence
from .workspace import NUM_SLOTS, measured_view, workspace_numel

__all__ = [
    "SPECS",
    "adalomo_update_",
    "adalomo_step_arguments",
    "check_adalomo_state",
    "run_adalomo_passes_",
    "init_adalomo_state",
    "adalomo_workspace",
    "adalomo_factored_stats_",
    "adalomo_factored_moments_",
    "adalomo_factored_norm_",
    "adalomo_factored_apply_",
    "adalomo_vector_stats_",
    "adalomo_vector_apply_",
]

from .spec import (
    _FACTORED,
    _VECTOR,
    FACTORED_APPLY,
    FACTORED_MOMENTS,
    FACTORED_NORM,
    FACTORED_STATS,
    SPECS,
    VECTOR_APPLY,
    VECTOR_STATS,
)

# What one step of a factored / 1-D parameter checks before its first pass.
_FACTORED_STEP, _VECTOR_STEP = Conversion(*_FACTORED), Conversion(*_VECTOR)

# The ops as the public functions call them: ``op(backend, **arguments)`` (eager.py).
factored_stats_op = define(FACTORED_STATS, ADALOMO)
factored_moments_op = define(FACTORED_MOMENTS, ADALOMO)
factored_norm_op = define(FACTORED_NORM, ADALOMO)
factored_apply_op = define(FACTORED_APPLY, ADALOMO)
vector_stats_op = define(VECTOR_STATS, ADALOMO)
vector_apply_op = define(VECTOR_APPLY, ADALOMO)
# One step's passes, in order (`run_adalomo_passes_`).
_FACTORED_PASSES = FusedSequence(
    factored_stats_op, factored_moments_op, factored_norm_op, factored_apply_op
)
_VECTOR_PASSES = FusedSequence(vector_stats_op, vector_apply_op)


# ----------------------------------------------------------------------------- validation


def _check_state(name: str, t: torch.Tensor, numel: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"lomo_kernels: state {name!r} must be a tensor, got {type(t)}")
    if t.dtype != torch.float32 or t.numel() != numel or not t.is_contiguous():
        raise ValueError(
            f"lomo_kernels: state {name!r} must be a contiguous float32 tensor of {numel} "
            f"elements, got shape {tuple(t.shape)} dtype {t.dtype}"
        )
    if t.device != device:
        raise ValueError(
            f"lomo_kernels: state {name!r} is on {t.device} but the parameter is on {device}"
        )


def _check_workspace(workspace: torch.Tensor, shape: torch.Size, device: torch.device) -> None:
    _check_state("workspace", workspace, workspace_numel(shape), device)


def _rows_cols(shape: torch.Size) -> tuple[int, int]:
    cols = shape[-1]
    return shape.numel() // cols, cols


# ----------------------------------------------------------------------------- public API


def init_adalomo_state(param: torch.Tensor) -> dict[str, torch.Tensor]:
    """Zeroed fp32 second-moment state of `param`, on its device.

    Tensors with >= 2 dims get factored moments ``exp_avg_sq_row`` [numel // shape[-1]] and
    ``exp_avg_sq_col`` [shape[-1]]; 0-d and 1-D tensors get ``exp_avg_sq`` [numel].
    """
    options = {"dtype": torch.float32, "device": param.device}
    if param.dim() >= 2:
        rows, cols = _rows_cols(param.shape)
        return {
            "exp_avg_sq_row": torch.zeros(rows, **options),
            "exp_avg_sq_col": torch.zeros(cols, **options),
        }
    return {"exp_avg_sq": torch.zeros(param.numel(), **options)}


def adalomo_workspace(param: torch.Tensor) -> torch.Tensor:
    """The zeroed fp32 workspace one step of `param` needs (one allocation, one launch)."""
    return torch.zeros(workspace_numel(param.shape), dtype=torch.float32, device=param.device)


def _eps_pair(eps: tuple[float, float]) -> tuple[float, float]:
    if not (isinstance(eps, tuple | list) and len(eps) == 2):
        raise TypeError(f"lomo_kernels: eps must be a pair (eps0, eps1), got {eps!r}")
    return float(eps[0]), float(eps[1])


def adalomo_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, torch.Tensor],
    *,
    lr: Scalar,
    beta2: Scalar,
    eps: tuple[float, float] = (1e-30, 1e-3),
    clip_threshold: float = 1.0,
    weight_decay: float = 0.0,
    inv_scale: Scalar | None = 1.0,
    clip_value: float | None = None,
    clip_coef: Scalar | None = None,
    found_inf: torch.Tensor | None = None,
    skip_if: torch.Tensor | None = None,
    stochastic_rounding: bool = False,
    seed: int = 0,
    seed_step: torch.Tensor | None = None,
    backend: str | None = None,
    on_grad_sumsq: Callable[[torch.Tensor], None] | None = None,
) -> None:
    """One AdaLomo step of `param` in place, with its second moments in `state`.

    In fp32: ``g = clamp(grad * inv_scale, -clip_value, clip_value) * clip_coef``,
    ``u = g*g + eps[0]``. With >= 2 dims ([rows, cols], cols = shape[-1]):
    ``R = beta2*R + (1-beta2)*mean_j u``, ``C = beta2*C + (1-beta2)*mean_i u``,
    ``update = g * rsqrt(R_i / mean(R)) * rsqrt(C_j)``; 1-D: ``v = beta2*v + (1-beta2)*u``,
    ``update = g * rsqrt(v)``. Then ``update /= max(1, rms(update) / clip_threshold)``,
    ``lr_t = lr * max(eps[1], rms(param))``, ``param = param*(1 - lr_t*wd) - lr_t*update``,
    written back in the parameter's dtype: round to nearest even, or with
    ``stochastic_rounding=True`` (bf16 and fp16 parameters) stochastically, from ``seed``,
    ``seed_step`` and the element index as `fused_lomo_update_` rounds. Factored tensors form
    ``mean u`` as ``clip_coef * (clip_coef * mean(g0*g0)) + eps[0]``, g0 being g before the
    coefficient (the same value up to rounding; see `adalomo_reference`).

    `state` is filled by `init_adalomo_state` when empty. If any ``grad * inv_scale`` is
    inf/nan, the parameter and its moments keep their exact bits and ``found_inf`` (1-element
    fp32) is raised to 1. When ``skip_if`` is given and non-zero, nothing is written at all.
    `lr`, `beta2`, `inv_scale`, `clip_coef` may be 1-element fp32 device tensors; the step
    never synchronises with the host. Factored: 5 launches (zeroing the workspace, 3 passes
    over grad, 2 over param); 1-D: 3 launches.

    ``on_grad_sumsq`` (tensors with >= 2 dims only): called after pass A, before anything
    reads ``clip_coef``, with the workspace's 2-element view [sum((grad * inv_scale)^2),
    non-finite flag]; it may write the value of a `clip_coef` tensor (single_backward
    computes the coefficient from that very sum, see `optim.single_backward`).
    """
    check_pair(param, grad)
    check_stochastic_rounding(param, stochastic_rounding, "parameter")
    factored = param.dim() >= 2
    arguments = adalomo_step_arguments(
        param.device,
        factored,
        lr=lr,
        beta2=beta2,
        eps=eps,
        clip_threshold=clip_threshold,
        weight_decay=weight_decay,
        inv_scale=inv_scale,
        clip_value=clip_value,
        clip_coef=clip_coef,
        found_inf=found_inf,
        skip_if=skip_if,
        stochastic_rounding=stochastic_rounding,
        seed=seed,
        seed_step=seed_step,
    )
    arguments.update(param=param, grad=grad.contiguous())  # contiguous once, not per pass
    if not state:
        state.update(init_adalomo_state(param))
    if param.numel() == 0:
        return
    arguments["workspace"] = adalomo_workspace(param)
    # Resolved once for the step's passes (eager; a traced step runs the device's backend).
    if not torch.compiler.is_compiling() and (param.is_cpu or param.is_cuda):
        backend = ADALOMO.resolve(param.device, backend)
    check_adalomo_state(param, state)
    arguments.update(state)
    run_adalomo_passes_(backend, arguments, on_grad_sumsq)


def adalomo_step_arguments(
    device: torch.device,
    factored: bool,
    *,
    lr: Scalar,
    beta2: Scalar,
    eps: tuple[float, float],
    clip_threshold: float,
    weight_decay: float,
    inv_scale: Scalar | None,
    clip_value: float | None,
    clip_coef: Scalar | None,
    found_inf: torch.Tensor | None,
    skip_if: torch.Tensor | None,
    stochastic_rounding: bool = False,
    seed: int = 0,
    seed_step: torch.Tensor | None = None,
) -> dict[str, Any]:
    """`adalomo_update_`'s public checks and conversions of everything but the tensors of
    one parameter (of a factored or a 1-D one): the step-wide arguments of its passes by
    name, as `run_adalomo_passes_` takes them. Raises, naming the argument, before anything
    runs; an optimizer runs it once per step on the values its per-tensor calls pass."""
    eps0, eps1 = _eps_pair(eps)
    return (_FACTORED_STEP if factored else _VECTOR_STEP).convert(
        device,
        {
            "lr": lr,
            "beta2": beta2,
            "eps0": eps0,
            "eps1": eps1,
            "clip_threshold": clip_threshold,
            "weight_decay": weight_decay,
            "inv_scale": inv_scale,
            "clip_value": clip_value,
            "clip_coef": clip_coef,
            "found_inf": found_inf,
            "skip_if": skip_if,
            "stochastic_rounding": stochastic_rounding,
            "seed": seed,
            "seed_step": seed_step,
        },
    )


def check_adalomo_state(
    param: torch.Tensor, state: dict[str, torch.Tensor], full_shape: torch.Size | None = None
) -> None:
    """Refuses, by name, a `state` not in the form `init_adalomo_state(param)` gives.

    `full_shape`: `param` is one rank's flat slice of a parameter of that shape, whose
    factored moments span the whole matrix and whose 1-D moment the slice only (the form a
    sharded optimizer keeps)."""
    device = param.device
    shape = param.shape if full_shape is None else full_shape
    if len(shape) >= 2:
        rows, cols = _rows_cols(shape)
        _check_state("exp_avg_sq_row", state["exp_avg_sq_row"], rows, device)
        _check_state("exp_avg_sq_col", state["exp_avg_sq_col"], cols, device)
    else:
        _check_state("exp_avg_sq", state["exp_avg_sq"], param.numel(), device)


def run_adalomo_passes_(
    backend: str | ModuleType | None,
    arguments: dict[str, Any],
    on_grad_sumsq: Callable[[torch.Tensor], None] | None = None,
) -> None:
    """The passes of one `adalomo_update_` step on arguments already checked and converted.

    `arguments`: `adalomo_step_arguments`' values plus ``param``, ``grad`` (contiguous),
    ``workspace`` (zeroed, `adalomo_workspace`) and the parameter's state tensors by their
    names (`check_adalomo_state`), for a parameter with at least one element; `backend` a
    name, or the module `ADALOMO.resolve` returned (None under tracing: the device's). The
    passes run as a `FusedSequence`: eager with a module, the fast path's checks once for
    all of them; traced, or with anything listening, each op through the dispatcher.
    """
    param = arguments["param"]
    if param.dim() >= 2:
        arguments["cols"] = param.shape[-1]
        arguments["offset"] = 0  # the whole tensor (slices: `optim/adalomo_slices.py`)
        between = None
        if on_grad_sumsq is not None:
            between = functools.partial(on_grad_sumsq, measured_view(arguments["workspace"]))
        _FACTORED_PASSES(backend, arguments, between)
    else:
        arguments.update(offset=0, full_numel=param.numel())  # the whole tensor
        _VECTOR_PASSES(backend, arguments)


def _check_factored(
    param_or_grad: torch.Tensor,
    grad: torch.Tensor,
    row: torch.Tensor | None,
    col: torch.Tensor | None,
    workspace: torch.Tensor,
) -> None:
    """The arguments of a factored pass over a whole tensor; `param_or_grad` is grad itself
    in pass B."""
    check_pair(param_or_grad, grad)
    if param_or_grad.dim() < 2:
        raise ValueError("lomo_kernels: factored passes need a tensor with >= 2 dims")
    rows, cols = _rows_cols(param_or_grad.shape)
    device = param_or_grad.device
    if row is not None:
        _check_state("exp_avg_sq_row", row, rows, device)
    if col is not None:
        _check_state("exp_avg_sq_col", col, cols, device)
    _check_workspace(workspace, param_or_grad.shape, device)


def _check_factored_update(
    param_or_grad: torch.Tensor,
    grad: torch.Tensor,
    row: torch.Tensor,
    col: torch.Tensor,
    workspace: torch.Tensor,
    offset: int,
) -> None:
    """The arguments of pass B or C: a tensor of the moments' shape at offset 0 (as
    `_check_factored`), or a 1-D slice of their [rows, cols] matrix at flat `offset`."""
    if param_or_grad.dim() >= 2:
        if offset:
            raise ValueError(
                f"lomo_kernels: offset {offset} is for a 1-D slice of the moments' matrix, got "
                f"a tensor of shape {tuple(param_or_grad.shape)}: pass its flat view"
            )
        _check_factored(param_or_grad, grad, row, col, workspace)
        return
    check_pair(param_or_grad, grad)
    device = param_or_grad.device
    rows, cols = row.numel(), col.numel()
    _check_state("exp_avg_sq_row", row, rows, device)
    _check_state("exp_avg_sq_col", col, cols, device)
    _check_state("workspace", workspace, rows + cols + NUM_SLOTS, device)
    _check_slice_fits(param_or_grad, offset, rows * cols, f"the moments' {rows} x {cols} matrix")


def _check_slice_fits(part: torch.Tensor, offset: int, whole: int, what: str) -> None:
    """Refuses a slice `part` at flat `offset` that ends past the `whole` elements of `what`
    (the offset's type and sign are the spec's to check)."""
    if isinstance(offset, int) and offset + part.numel() > whole:
        raise ValueError(
            f"lomo_kernels: a slice of {part.numel()} elements at offset {offset!r} does not "
            f"fit {what}"
        )


def _run(op: FusedOp, backend: str | None, device: torch.device, public: dict, **derived) -> None:
    """Runs `op` on its arguments taken by name from `public` (a public function's
    arguments) and `derived`, checked and converted by its spec; nothing runs on no element."""
    if "grad" in public:
        derived["grad"] = public["grad"].contiguous()
    arguments = op.spec.convert(device, op.spec.take(public, **derived))
    if arguments[op.spec.names[0]].numel():
        op(backend, **arguments)


def adalomo_factored_stats_(
    grad: torch.Tensor,
    param: torch.Tensor,
    workspace: torch.Tensor,
    *,
    inv_scale: Scalar | None = 1.0,
    clip_value: float | None = None,
    found_inf: torch.Tensor | None = None,
    skip_if: torch.Tensor | None = None,
    offset: int = 0,
    full_shape: Sequence[int] | None = None,
    backend: str | None = None,
) -> None:
    """Pass A of a >= 2-D parameter: one read of grad and param.

    With ``h = grad * inv_scale`` and ``g = clamp(h, -clip_value, clip_value)`` (no clip
    coefficient: `adalomo_factored_moments_` applies it), adds the row sums and column sums
    of ``g*g``, ``sum(h^2)`` (G_SUMSQ, as `grad_sumsq_` measures it) and ``sum(param^2)``
    into `workspace`; a non-finite h sets its SKIP slot and raises `found_inf`. With
    ``skip_if`` non-zero it sets SKIP and raises nothing (the sums are then not used).

    A shard's slice: `grad` and `param` are 1-D and hold the flat elements [offset, offset +
    numel) of a parameter of `full_shape`, whose workspace this is (a rank's share of the
    sums: the rows and columns it touches, its part of every slot)."""
    if full_shape is None:
        if offset:
            raise ValueError(
                f"lomo_kernels: offset {offset!r} is for a 1-D slice of a parameter: pass its "
                "full_shape too"
            )
        _check_factored(param, grad, None, None, workspace)
        cols = param.shape[-1]
    else:
        full_shape = torch.Size(full_shape)
        if len(full_shape) < 2 or param.dim() != 1:
            raise ValueError(
                "lomo_kernels: full_shape is for a 1-D slice of a parameter with >= 2 dims, got "
                f"a slice of shape {tuple(param.shape)} of full_shape {tuple(full_shape)}"
            )
        check_pair(param, grad)
        _check_workspace(workspace, full_shape, param.device)
        _check_slice_fits(param, offset, full_shape.numel(), f"full_shape {tuple(full_shape)}")
        cols = full_shape[-1]
    _run(factored_stats_op, backend, param.device, locals(), cols=cols)


def adalomo_factored_moments_(
    exp_avg_sq_row: torch.Tensor,
    exp_avg_sq_col: torch.Tensor,
    workspace: torch.Tensor,
    *,
    beta2: Scalar,
    clip_coef: Scalar | None = None,
    eps0: float = 1e-30,
    backend: str | None = None,
) -> None:
    """Updates R and C from the sums of pass A (unless SKIP is set) and stores sum(R).

    The means of ``u = (clip_coef * g)^2 + eps0`` are formed here from pass A's sums of
    ``g^2``: ``clip_coef * (clip_coef * sum / count) + eps0``.
    """
    device = workspace.device
    rows, cols = exp_avg_sq_row.numel(), exp_avg_sq_col.numel()
    _check_state("exp_avg_sq_row", exp_avg_sq_row, rows, device)
    _check_state("exp_avg_sq_col", exp_avg_sq_col, cols, device)
    _check_state("workspace", workspace, rows + cols + NUM_SLOTS, device)
    if exp_avg_sq_col.numel():  # (no row: the op's first argument is empty)
        _run(factored_moments_op, backend, device, locals())


def adalomo_factored_norm_(
    grad: torch.Tensor,
    exp_avg_sq_row: torch.Tensor,
    exp_avg_sq_col: torch.Tensor,
    workspace: torch.Tensor,
    *,
    inv_scale: Scalar | None = 1.0,
    clip_value: float | None = None,
    clip_coef: Scalar | None = None,
    offset: int = 0,
    backend: str | None = None,
) -> None:
    """Pass B: adds ``sum((g * rsqrt(R_i / mean(R)) * rsqrt(C_j))^2)`` to the U_SUMSQ slot.

    `grad` has the moments' shape, or is a 1-D slice of their [rows, cols] matrix holding its
    flat elements [offset, offset + numel) (a shard's part of the sum)."""
    _check_factored_update(grad, grad, exp_avg_sq_row, exp_avg_sq_col, workspace, offset)
    _run(factored_norm_op, backend, grad.device, locals())


def adalomo_factored_apply_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg_sq_row: torch.Tensor,
    exp_avg_sq_col: torch.Tensor,
    workspace: torch.Tensor,
    *,
    lr: Scalar,
    eps1: float = 1e-3,
    clip_threshold: float = 1.0,
    weight_decay: float = 0.0,
    inv_scale: Scalar | None = 1.0,
    clip_value: float | None = None,
    clip_coef: Scalar | None = None,
    stochastic_rounding: bool = False,
    seed: int = 0,
    seed_step: torch.Tensor | None = None,
    offset: int = 0,
    backend: str | None = None,
) -> None:
    """Pass C: ``param = param * decay - scale * update`` unless SKIP is set.

    ``lr_t = lr * max(eps1, rms(param))``, ``scale = lr_t / max(1, rms(update) /
    clip_threshold)``, ``decay = 1 - lr_t * weight_decay``, from the workspace sums over the
    moments' whole [rows, cols] matrix; the write-back rounds as `adalomo_update_`'s. `param`
    and `grad` have the moments' shape, or are 1-D slices of that matrix holding its flat
    elements [offset, offset + numel): the rounding then draws the bits of each element's
    index in the whole matrix, so slices step as the whole tensor would.
    """
    _check_factored_update(param, grad, exp_avg_sq_row, exp_avg_sq_col, workspace, offset)
    check_stochastic_rounding(param, stochastic_rounding, "parameter")
    _run(factored_apply_op, backend, param.device, locals())


def adalomo_vector_stats_(
    grad: torch.Tensor,
    param: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    workspace: torch.Tensor,
    *,
    beta2: Scalar,
    eps0: float = 1e-30,
    inv_scale: Scalar | None = 1.0,
    clip_value: float | None = None,
    clip_coef: Scalar | None = None,
    found_inf: torch.Tensor | None = None,
    skip_if: torch.Tensor | None = None,
    backend: str | None = None,
) -> None:
    """Pass A1 of a 1-D parameter: one read of grad, param and v (v is not written).

    Adds ``sum((g * rsqrt(v_new))^2)`` (``v_new = beta2*v + (1-beta2)*(g*g + eps0)``) and
    ``sum(param^2)`` to the workspace; flags as `adalomo_factored_stats_`.
    """
    _check_vector(param, grad, exp_avg_sq, workspace)
    _run(vector_stats_op, backend, param.device, locals())


def adalomo_vector_apply_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    workspace: torch.Tensor,
    *,
    lr: Scalar,
    beta2: Scalar,
    eps0: float = 1e-30,
    eps1: float = 1e-3,
    clip_threshold: float = 1.0,
    weight_decay: float = 0.0,
    inv_scale: Scalar | None = 1.0,
    clip_value: float | None = None,
    clip_coef: Scalar | None = None,
    stochastic_rounding: bool = False,
    seed: int = 0,
    seed_step: torch.Tensor | None = None,
    offset: int = 0,
    full_numel: int | None = None,
    backend: str | None = None,
) -> None:
    """Pass C1: ``v = v_new``, ``param = param * decay - scale * g * rsqrt(v_new)`` unless
    SKIP is set (scalars and rounding as in `adalomo_factored_apply_`).

    A shard's slice: `param`, `grad` and `exp_avg_sq` hold elements [offset, offset + numel)
    of a 1-D parameter of `full_numel` elements (default: `param`'s own), whose sums the
    workspace holds; the rounding draws the bits of each element's index in it."""
    _check_vector(param, grad, exp_avg_sq, workspace)
    check_stochastic_rounding(param, stochastic_rounding, "parameter")
    if full_numel is None:
        full_numel = param.numel()
    _check_slice_fits(param, offset, full_numel, f"a parameter of full_numel={full_numel} elements")
    _run(vector_apply_op, backend, param.device, locals())


def _check_vector(
    param: torch.Tensor, grad: torch.Tensor, exp_avg_sq: torch.Tensor, workspace: torch.Tensor
) -> None:
    check_pair(param, grad)
    _check_state("exp_avg_sq", exp_avg_sq, param.numel(), param.device)
    _check_state("workspace", workspace, NUM_SLOTS, param.device)
