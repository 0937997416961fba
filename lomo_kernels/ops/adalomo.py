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
(`adalomo_workspace.py`). Because pass A measures the gradient's sum of squares before
anything uses the clip coefficient, a caller may compute that coefficient from it between
pass A and the moments (`adalomo_update_`'s ``on_grad_sumsq``). The public functions accept
the runtime scalars (lr, beta2, inv_scale, clip_coef) as Python floats or 1-element fp32
device tensors and convert them once (`scalars.py`); the ops take tensors only, and nothing
reads a device value on the host, so a step never synchronises. Kernels per device: `backends.py`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import adalomo_reference as reference
from .adalomo_workspace import NUM_SLOTS, measured_view, workspace_numel
from .backends import ADALOMO, register_kernels, requested_backend
from .checks import check_finite, check_pair, check_scalar_tensor
from .scalars import Scalar, device_scalar, grad_transform, optional_factor

__all__ = [
    "adalomo_update_",
    "init_adalomo_state",
    "adalomo_workspace",
    "adalomo_factored_stats_",
    "adalomo_factored_moments_",
    "adalomo_factored_norm_",
    "adalomo_factored_apply_",
    "adalomo_vector_stats_",
    "adalomo_vector_apply_",
]

Tensor = torch.Tensor

# ----------------------------------------------------------------------------- schemas
# Each body is the reference (any device); `register_kernels` adds the fake and the CPU and
# CUDA kernels. Argument order is the kernels' order (csrc/ bindings, Triton launchers).


@torch.library.custom_op(
    "lomo_kernels::adalomo_factored_stats_", mutates_args=("workspace", "found_inf")
)
def _factored_stats_op(
    grad: Tensor,
    param: Tensor,
    workspace: Tensor,
    found_inf: Tensor | None,
    skip_if: Tensor | None,
    cols: int,
    inv_scale: Tensor | None,
    clip_value: float | None,
    backend: str,
) -> None:
    reference.factored_stats_(
        grad, param, workspace, found_inf, skip_if, cols, inv_scale, clip_value
    )


@torch.library.custom_op(
    "lomo_kernels::adalomo_factored_moments_",
    mutates_args=("exp_avg_sq_row", "exp_avg_sq_col", "workspace"),
)
def _factored_moments_op(
    exp_avg_sq_row: Tensor,
    exp_avg_sq_col: Tensor,
    workspace: Tensor,
    beta2: Tensor,
    clip_coef: Tensor | None,
    eps0: float,
    backend: str,
) -> None:
    reference.factored_moments_(exp_avg_sq_row, exp_avg_sq_col, workspace, beta2, clip_coef, eps0)


@torch.library.custom_op("lomo_kernels::adalomo_factored_norm_", mutates_args=("workspace",))
def _factored_norm_op(
    grad: Tensor,
    exp_avg_sq_row: Tensor,
    exp_avg_sq_col: Tensor,
    workspace: Tensor,
    inv_scale: Tensor | None,
    clip_value: float | None,
    clip_coef: Tensor | None,
    backend: str,
) -> None:
    reference.factored_norm_(
        grad, exp_avg_sq_row, exp_avg_sq_col, workspace, inv_scale, clip_value, clip_coef
    )


@torch.library.custom_op("lomo_kernels::adalomo_factored_apply_", mutates_args=("param",))
def _factored_apply_op(
    param: Tensor,
    grad: Tensor,
    exp_avg_sq_row: Tensor,
    exp_avg_sq_col: Tensor,
    workspace: Tensor,
    lr: Tensor,
    eps1: float,
    clip_threshold: float,
    weight_decay: float,
    inv_scale: Tensor | None,
    clip_value: float | None,
    clip_coef: Tensor | None,
    backend: str,
) -> None:
    reference.factored_apply_(
        param,
        grad,
        exp_avg_sq_row,
        exp_avg_sq_col,
        workspace,
        lr,
        eps1,
        clip_threshold,
        weight_decay,
        inv_scale,
        clip_value,
        clip_coef,
    )


@torch.library.custom_op(
    "lomo_kernels::adalomo_vector_stats_", mutates_args=("workspace", "found_inf")
)
def _vector_stats_op(
    grad: Tensor,
    param: Tensor,
    exp_avg_sq: Tensor,
    workspace: Tensor,
    found_inf: Tensor | None,
    skip_if: Tensor | None,
    beta2: Tensor,
    eps0: float,
    inv_scale: Tensor | None,
    clip_value: float | None,
    clip_coef: Tensor | None,
    backend: str,
) -> None:
    reference.vector_stats_(
        grad,
        param,
        exp_avg_sq,
        workspace,
        found_inf,
        skip_if,
        beta2,
        eps0,
        inv_scale,
        clip_value,
        clip_coef,
    )


@torch.library.custom_op(
    "lomo_kernels::adalomo_vector_apply_", mutates_args=("param", "exp_avg_sq")
)
def _vector_apply_op(
    param: Tensor,
    grad: Tensor,
    exp_avg_sq: Tensor,
    workspace: Tensor,
    beta2: Tensor,
    eps0: float,
    lr: Tensor,
    eps1: float,
    clip_threshold: float,
    weight_decay: float,
    inv_scale: Tensor | None,
    clip_value: float | None,
    clip_coef: Tensor | None,
    backend: str,
) -> None:
    reference.vector_apply_(
        param,
        grad,
        exp_avg_sq,
        workspace,
        beta2,
        eps0,
        lr,
        eps1,
        clip_threshold,
        weight_decay,
        inv_scale,
        clip_value,
        clip_coef,
    )


# The ops as callers use them: eager calls skip the dispatcher's Python layers (eager.py).
factored_stats_op = register_kernels(_factored_stats_op, ADALOMO, "factored_stats_")
factored_moments_op = register_kernels(_factored_moments_op, ADALOMO, "factored_moments_")
factored_norm_op = register_kernels(_factored_norm_op, ADALOMO, "factored_norm_")
factored_apply_op = register_kernels(_factored_apply_op, ADALOMO, "factored_apply_")
vector_stats_op = register_kernels(_vector_stats_op, ADALOMO, "vector_stats_")
vector_apply_op = register_kernels(_vector_apply_op, ADALOMO, "vector_apply_")


# ----------------------------------------------------------------------------- validation


def _beta2(beta2: Scalar, device: torch.device) -> Tensor:
    return device_scalar("beta2", beta2, device, unit_interval=True)


def _lr(lr: Scalar, device: torch.device) -> Tensor:
    return device_scalar("lr", lr, device, non_negative=True)


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
    written back in the parameter's dtype (round to nearest even). Factored tensors form
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
    device = param.device
    if not (isinstance(eps, tuple | list) and len(eps) == 2):
        raise TypeError(f"lomo_kernels: eps must be a pair (eps0, eps1), got {eps!r}")
    eps0, eps1 = float(eps[0]), float(eps[1])
    check_finite("eps[0]", eps0, non_negative=True)
    check_finite("eps[1]", eps1, non_negative=True)
    check_finite("clip_threshold", clip_threshold, positive=True)
    check_finite("weight_decay", weight_decay)
    lr_t = _lr(lr, device)
    beta2_t = _beta2(beta2, device)
    ga = grad_transform(inv_scale, clip_value, clip_coef, device)
    check_scalar_tensor("found_inf", found_inf, device)
    check_scalar_tensor("skip_if", skip_if, device)
    if not state:
        state.update(init_adalomo_state(param))
    if param.numel() == 0:
        return
    name = requested_backend(backend)
    grad = grad.contiguous()  # once here rather than in each pass
    workspace = adalomo_workspace(param)
    wd = float(weight_decay)
    threshold = float(clip_threshold)
    if param.dim() >= 2:
        rows, cols = _rows_cols(param.shape)
        row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
        _check_state("exp_avg_sq_row", row, rows, device)
        _check_state("exp_avg_sq_col", col, cols, device)
        inv_t, clip_value_f, coef_t = ga
        factored_stats_op(
            grad, param, workspace, found_inf, skip_if, cols, inv_t, clip_value_f, name
        )
        if on_grad_sumsq is not None:
            on_grad_sumsq(measured_view(workspace))
        factored_moments_op(row, col, workspace, beta2_t, coef_t, eps0, name)
        factored_norm_op(grad, row, col, workspace, *ga, name)
        factored_apply_op(param, grad, row, col, workspace, lr_t, eps1, threshold, wd, *ga, name)
    else:
        v = state["exp_avg_sq"]
        _check_state("exp_avg_sq", v, param.numel(), device)
        vector_stats_op(grad, param, v, workspace, found_inf, skip_if, beta2_t, eps0, *ga, name)
        vector_apply_op(
            param,
            grad,
            v,
            workspace,
            beta2_t,
            eps0,
            lr_t,
            eps1,
            threshold,
            wd,
            *ga,
            name,
        )


def _check_factored(
    param_or_grad: torch.Tensor,
    row: torch.Tensor | None,
    col: torch.Tensor | None,
    workspace: torch.Tensor,
) -> None:
    if param_or_grad.dim() < 2:
        raise ValueError("lomo_kernels: factored passes need a tensor with >= 2 dims")
    rows, cols = _rows_cols(param_or_grad.shape)
    device = param_or_grad.device
    if row is not None:
        _check_state("exp_avg_sq_row", row, rows, device)
    if col is not None:
        _check_state("exp_avg_sq_col", col, cols, device)
    _check_workspace(workspace, param_or_grad.shape, device)


def adalomo_factored_stats_(
    grad: torch.Tensor,
    param: torch.Tensor,
    workspace: torch.Tensor,
    *,
    inv_scale: Scalar | None = 1.0,
    clip_value: float | None = None,
    found_inf: torch.Tensor | None = None,
    skip_if: torch.Tensor | None = None,
    backend: str | None = None,
) -> None:
    """Pass A of a >= 2-D parameter: one read of grad and param.

    With ``h = grad * inv_scale`` and ``g = clamp(h, -clip_value, clip_value)`` (no clip
    coefficient: `adalomo_factored_moments_` applies it), adds the row sums and column sums
    of ``g*g``, ``sum(h^2)`` (G_SUMSQ, as `grad_sumsq_` measures it) and ``sum(param^2)``
    into `workspace`; a non-finite h sets its SKIP slot and raises `found_inf`. With
    ``skip_if`` non-zero it sets SKIP and raises nothing (the sums are then not used).
    """
    check_pair(param, grad)
    _check_factored(param, None, None, workspace)
    check_scalar_tensor("found_inf", found_inf, param.device)
    check_scalar_tensor("skip_if", skip_if, param.device)
    inv_t, clip_value_f, _ = grad_transform(inv_scale, clip_value, None, param.device)
    if param.numel() == 0:
        return
    torch.ops.lomo_kernels.adalomo_factored_stats_(
        grad.contiguous(),
        param,
        workspace,
        found_inf,
        skip_if,
        param.shape[-1],
        inv_t,
        clip_value_f,
        requested_backend(backend),
    )


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
    beta2_t = _beta2(beta2, device)
    coef_t = optional_factor("clip_coef", clip_coef, device)
    check_finite("eps0", eps0, non_negative=True)
    if rows * cols == 0:
        return
    torch.ops.lomo_kernels.adalomo_factored_moments_(
        exp_avg_sq_row,
        exp_avg_sq_col,
        workspace,
        beta2_t,
        coef_t,
        float(eps0),
        requested_backend(backend),
    )


def adalomo_factored_norm_(
    grad: torch.Tensor,
    exp_avg_sq_row: torch.Tensor,
    exp_avg_sq_col: torch.Tensor,
    workspace: torch.Tensor,
    *,
    inv_scale: Scalar | None = 1.0,
    clip_value: float | None = None,
    clip_coef: Scalar | None = None,
    backend: str | None = None,
) -> None:
    """Pass B: adds ``sum((g * rsqrt(R_i / mean(R)) * rsqrt(C_j))^2)`` to the U_SUMSQ slot."""
    check_pair(grad, grad)
    _check_factored(grad, exp_avg_sq_row, exp_avg_sq_col, workspace)
    ga = grad_transform(inv_scale, clip_value, clip_coef, grad.device)
    if grad.numel() == 0:
        return
    torch.ops.lomo_kernels.adalomo_factored_norm_(
        grad.contiguous(),
        exp_avg_sq_row,
        exp_avg_sq_col,
        workspace,
        *ga,
        requested_backend(backend),
    )


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
    backend: str | None = None,
) -> None:
    """Pass C: ``param = param * decay - scale * update`` unless SKIP is set.

    ``lr_t = lr * max(eps1, rms(param))``, ``scale = lr_t / max(1, rms(update) /
    clip_threshold)``, ``decay = 1 - lr_t * weight_decay``, from the workspace sums.
    """
    check_pair(param, grad)
    _check_factored(param, exp_avg_sq_row, exp_avg_sq_col, workspace)
    lr_t = _lr(lr, param.device)
    check_finite("eps1", eps1, non_negative=True)
    check_finite("clip_threshold", clip_threshold, positive=True)
    check_finite("weight_decay", weight_decay)
    ga = grad_transform(inv_scale, clip_value, clip_coef, param.device)
    if param.numel() == 0:
        return
    torch.ops.lomo_kernels.adalomo_factored_apply_(
        param,
        grad.contiguous(),
        exp_avg_sq_row,
        exp_avg_sq_col,
        workspace,
        lr_t,
        float(eps1),
        float(clip_threshold),
        float(weight_decay),
        *ga,
        requested_backend(backend),
    )


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
    check_pair(param, grad)
    device = param.device
    _check_state("exp_avg_sq", exp_avg_sq, param.numel(), device)
    _check_state("workspace", workspace, NUM_SLOTS, device)
    beta2_t = _beta2(beta2, device)
    check_finite("eps0", eps0, non_negative=True)
    check_scalar_tensor("found_inf", found_inf, device)
    check_scalar_tensor("skip_if", skip_if, device)
    ga = grad_transform(inv_scale, clip_value, clip_coef, device)
    if param.numel() == 0:
        return
    torch.ops.lomo_kernels.adalomo_vector_stats_(
        grad.contiguous(),
        param,
        exp_avg_sq,
        workspace,
        found_inf,
        skip_if,
        beta2_t,
        float(eps0),
        *ga,
        requested_backend(backend),
    )


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
    backend: str | None = None,
) -> None:
    """Pass C1: ``v = v_new``, ``param = param * decay - scale * g * rsqrt(v_new)`` unless
    SKIP is set (scalars as in `adalomo_factored_apply_`)."""
    check_pair(param, grad)
    device = param.device
    _check_state("exp_avg_sq", exp_avg_sq, param.numel(), device)
    _check_state("workspace", workspace, NUM_SLOTS, device)
    lr_t = _lr(lr, device)
    beta2_t = _beta2(beta2, device)
    check_finite("eps0", eps0, non_negative=True)
    check_finite("eps1", eps1, non_negative=True)
    check_finite("clip_threshold", clip_threshold, positive=True)
    check_finite("weight_decay", weight_decay)
    ga = grad_transform(inv_scale, clip_value, clip_coef, device)
    if param.numel() == 0:
        return
    torch.ops.lomo_kernels.adalomo_vector_apply_(
        param,
        grad.contiguous(),
        exp_avg_sq,
        workspace,
        beta2_t,
        float(eps0),
        lr_t,
        float(eps1),
        float(clip_threshold),
        float(weight_decay),
        *ga,
        requested_backend(backend),
    )
