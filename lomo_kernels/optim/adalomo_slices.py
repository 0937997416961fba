"""AdaLomo on slices of parameters: the statistics that span ranks, reduced across them.

A rank owns a flat slice ``[offset, offset + n)`` of each parameter, which for a matrix
[rows, cols] cuts across rows. AdaLomo needs, per parameter: the row and column sums of
``g*g`` before the clip coefficient (factored, >= 2 dims; the coefficient and eps0 are
applied to the means, as by the moments pass), ``sum(update^2)`` and ``sum(p^2)`` over the
whole tensor, and whether any gradient element is non-finite. Each rank adds up its slice's
share with the fused passes (`ops.adalomo`), which take the slice at its offset: pass A
writes the rows and columns it touches into a workspace laid out for the whole matrix. Per
batch of slices (a reduce-scatter bucket, an FSDP2 unit) two all-reduces, asked of the
sharding (the batch's workspaces, then the factored slices' update sums, which need the new
moments), give every rank the single-process totals, so the moments R [rows] and C [cols],
replicated on every rank, stay identical everywhere, and 1-D moments v live with their
slice.

Per slice, each pass is one launch whatever the slice's size: pass A, the moments, the norm
and the write-back (A1 and C1 for a 1-D slice). What spans the batch, its workspaces, the
skip decisions and the sums each all-reduce carries, is a few ops for the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from ..core.torch_internals import copy_each_
from ..distributed.shard import Shard
from ..ops.adalomo import (
    factored_apply_op,
    factored_moments_op,
    factored_norm_op,
    factored_stats_op,
    vector_apply_op,
    vector_stats_op,
)
from ..ops.adalomo.workspace import SKIP, U_SUMSQ, stats_slots, workspace_numel

F64 = torch.float64


@dataclass
class SliceStep:
    """One parameter slice's step: its reduced gradient, its moments and the passes'
    step-wide arguments (`ops.adalomo_step_arguments`' values, converted, with the
    parameter's rounding arguments); `backend`: a name, or the module `ADALOMO.resolve`
    gave (None: the device's)."""

    shard: Shard
    grad: torch.Tensor
    state: dict[str, torch.Tensor]
    arguments: dict[str, Any]
    skip: torch.Tensor | None = None  # non-zero: this slice's parameter is not updated
    backend: str | ModuleType | None = None


def init_slice_state(shard: Shard) -> dict[str, torch.Tensor]:
    """Moments for a sharded parameter: R, C of the full matrix, or v of the owned slice."""
    options = {"dtype": torch.float32, "device": shard.local.device}
    if len(shard.full_shape) >= 2:
        cols = shard.full_shape[-1]
        return {
            "exp_avg_sq_row": torch.zeros(shard.full_numel // cols, **options),
            "exp_avg_sq_col": torch.zeros(cols, **options),
        }
    return {"exp_avg_sq": torch.zeros(shard.local.numel(), **options)}


def _matrix(step: SliceStep) -> tuple[int, int] | None:
    """(rows, cols) of a factored parameter's matrix; None for a 1-D one."""
    shape = step.shard.full_shape
    if len(shape) < 2:
        return None
    return step.shard.full_numel // shape[-1], shape[-1]


def _run(op: Any, step: SliceStep, **tensors: Any) -> None:
    op.call_from(step.backend, {**step.arguments, **tensors})


def _first_sums(step: SliceStep, workspace: torch.Tensor) -> None:
    """This rank's share of its parameter's sums into `workspace` (pass A, or A1 for a 1-D
    slice, whose sum of update^2 is then already this share's)."""
    grad, local = step.grad.reshape(-1), step.shard.local.reshape(-1)
    if not local.numel():
        return
    flags = {"found_inf": None, "skip_if": None}  # decided once the ranks' flags are summed
    tensors = {"grad": grad, "param": local, "workspace": workspace, **flags}
    matrix = _matrix(step)
    if matrix is None:
        _run(vector_stats_op, step, **tensors, exp_avg_sq=step.state["exp_avg_sq"])
    else:
        _run(factored_stats_op, step, **tensors, cols=matrix[1], offset=step.shard.offset)


def _decide_skips(
    steps: list[SliceStep],
    workspaces: list[torch.Tensor],
    skip_if: torch.Tensor,
    found_inf: torch.Tensor,
) -> None:
    """Each parameter's SKIP slot from the summed flags: skipped where `skip_if` or its own
    `skip` is set, or any rank saw a non-finite gradient element (which raises `found_inf`
    unless `skip_if` is set)."""
    skip_in = skip_if.reshape(-1)[:1] != 0
    bad = torch.stack([stats_slots(w)[SKIP] for w in workspaces]) > 0
    own = [(skip_if if s.skip is None else s.skip).reshape(-1)[:1] for s in steps]
    skip = bad | skip_in | (torch.cat(own) != 0)
    flag = found_inf.view(-1)
    flag.copy_(torch.where((bad & ~skip_in).any(), torch.clamp(flag, min=1.0), flag))
    slots = [stats_slots(w)[SKIP : SKIP + 1] for w in workspaces]
    copy_each_(slots, list(skip.to(torch.float32).split(1)))


def adalomo_slices_(
    steps: list[SliceStep],
    skip_if: torch.Tensor,
    found_inf: torch.Tensor,
    all_reduce_sum_: Callable[[torch.Tensor], None],
) -> None:
    """One AdaLomo step of every slice in `steps` (one bucket); equal on all ranks' views.

    `skip_if` non-zero: nothing is written; a step's own `skip` non-zero: nothing of that
    parameter (the same flag on every rank, as single_backward gives). A parameter with a
    non-finite gradient element on any rank keeps its values and moments everywhere and
    raises `found_inf`.
    """
    if not steps:
        return
    sizes = [workspace_numel(s.shard.full_shape) for s in steps]
    flat = torch.zeros(sum(sizes), dtype=torch.float32, device=steps[0].grad.device)
    workspaces = list(flat.split(sizes))
    for step, workspace in zip(steps, workspaces, strict=True):
        _first_sums(step, workspace)
    # Every rank's sums, in float64: row and column sums, p^2 (and a 1-D slice's update^2),
    # the non-finite counts.
    totals = flat.to(F64)
    all_reduce_sum_(totals)
    flat.copy_(totals)
    _decide_skips(steps, workspaces, skip_if, found_inf)

    # New R and C (identical on every rank), then this rank's sum of update^2.
    factored = [(s, w) for s, w in zip(steps, workspaces, strict=True) if _matrix(s) is not None]
    for step, workspace in factored:
        moments = {k: step.state[k] for k in ("exp_avg_sq_row", "exp_avg_sq_col")}
        _run(factored_moments_op, step, workspace=workspace, **moments)
        if step.grad.numel():
            grad, offset = step.grad.reshape(-1), step.shard.offset
            _run(factored_norm_op, step, grad=grad, workspace=workspace, offset=offset, **moments)
    if factored:
        u_slots = [stats_slots(w)[U_SUMSQ : U_SUMSQ + 1] for _, w in factored]
        u_sumsqs = torch.cat(u_slots).to(F64)
        all_reduce_sum_(u_sumsqs)
        copy_each_(u_slots, list(u_sumsqs.to(torch.float32).split(1)))

    # The write-back (and a 1-D slice's v), with the whole parameter's sums.
    for step, workspace in zip(steps, workspaces, strict=True):
        local = step.shard.local.reshape(-1)
        if not local.numel():
            continue
        tensors = {"param": local, "grad": step.grad.reshape(-1), "workspace": workspace}
        if _matrix(step) is None:
            _run(
                vector_apply_op,
                step,
                **tensors,
                exp_avg_sq=step.state["exp_avg_sq"],
                offset=step.shard.offset,
                full_numel=step.shard.full_numel,
            )
            continue
        _run(
            factored_apply_op,
            step,
            **tensors,
            exp_avg_sq_row=step.state["exp_avg_sq_row"],
            exp_avg_sq_col=step.state["exp_avg_sq_col"],
            offset=step.shard.offset,
        )
