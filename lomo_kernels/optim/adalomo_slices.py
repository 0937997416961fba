"""AdaLomo on slices of parameters: the statistics that span ranks, reduced across them.

A rank owns a flat slice ``[offset, offset + n)`` of each parameter, which for a matrix
[rows, cols] cuts across rows. AdaLomo needs, per parameter: the row and column sums of
``g*g`` before the clip coefficient (factored, >= 2 dims; the coefficient and eps0 are
applied to the means, as by the moments pass), ``sum(update^2)`` and ``sum(p^2)`` over the
whole tensor, and whether any gradient element is non-finite. Each rank adds up its slice's
share with the fused passes (`ops.adalomo`); per batch of slices (a reduce-scatter bucket, an
FSDP2 unit) two small all-reduces, asked of the sharding (the row/column sums and flags, then
the update sums, which need the new moments), give every rank the single-process totals, so
the moments R [rows] and C [cols], replicated on every rank, stay identical everywhere, and
1-D moments v live with their slice.

Per slice, each phase is a few launches whatever its size: pass A on each of the at most
three pieces a flat slice makes of a matrix (a partial first row, whole rows, a partial last
row; `reference.row_pieces`), then the norm and the write-back on the slice itself, which
take its flat offset (pass A1 and C1 for a 1-D slice); the moments pass runs on the summed
row and column sums, as in one process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from ..distributed.shard import Shard
from ..ops.adalomo import (
    factored_apply_op,
    factored_moments_op,
    factored_norm_op,
    factored_stats_op,
    vector_apply_op,
    vector_stats_op,
)
from ..ops.adalomo.reference import row_pieces
from ..ops.adalomo.workspace import (
    NUM_SLOTS,
    P_SUMSQ,
    SKIP,
    U_SUMSQ,
    stats_slots,
    workspace_numel,
)

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


def _first_sums(step: SliceStep, workspace: torch.Tensor) -> torch.Tensor:
    """This rank's share, in float64, of [row sums, col sums of clamp(h)^2] (factored) +
    [sum p^2, non-finite flag]; a 1-D slice's sum of update^2 is left in `workspace`."""
    grad, local = step.grad.reshape(-1), step.shard.local.reshape(-1)
    flags = {"found_inf": None, "skip_if": None}  # decided once the ranks' flags are summed
    matrix = _matrix(step)
    if matrix is None:
        if local.numel():
            _run(
                vector_stats_op,
                step,
                grad=grad,
                param=local,
                workspace=workspace,
                exp_avg_sq=step.state["exp_avg_sq"],
                **flags,
            )
        return stats_slots(workspace)[[P_SUMSQ, SKIP]].to(F64)
    rows, cols = matrix
    sums = torch.zeros(rows + cols + 2, dtype=F64, device=grad.device)
    for start, row, nrows, col, width in row_pieces(step.shard.offset, local.numel(), cols):
        span = slice(start, start + nrows * width)
        piece = torch.zeros(nrows + width + NUM_SLOTS, dtype=torch.float32, device=grad.device)
        _run(
            factored_stats_op,
            step,
            grad=grad[span],
            param=local[span],
            workspace=piece,
            cols=width,
            **flags,
        )
        sums[row : row + nrows] += piece[:nrows]
        sums[rows + col : rows + col + width] += piece[nrows : nrows + width]
        sums[rows + cols :] += stats_slots(piece)[[P_SUMSQ, SKIP]]
    return sums


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
    device = steps[0].grad.device
    skip_in = skip_if.reshape(-1)[0] != 0
    workspaces = [
        torch.zeros(workspace_numel(s.shard.full_shape), dtype=torch.float32, device=device)
        for s in steps
    ]
    totals = torch.cat([_first_sums(s, w) for s, w in zip(steps, workspaces, strict=True)])
    all_reduce_sum_(totals)

    # Phase 2: new R and C (identical on every rank), then this rank's sum of update^2.
    at, second = 0, []
    for step, workspace in zip(steps, workspaces, strict=True):
        stats, matrix = stats_slots(workspace), _matrix(step)
        if matrix is not None:
            rows, cols = matrix
            workspace[: rows + cols] = totals[at : at + rows + cols]  # the moments pass's sums
            at += rows + cols
        p_sumsq, bad = totals[at], totals[at + 1] > 0
        at += 2
        skip = skip_in | bad
        if step.skip is not None:
            skip = skip | (step.skip.reshape(-1)[0] != 0)
        flag = found_inf.view(-1)
        flag.copy_(torch.where(bad & ~skip_in, torch.clamp(flag, min=1.0), flag))
        stats[SKIP] = skip.to(torch.float32)
        stats[P_SUMSQ] = p_sumsq.to(torch.float32)
        if matrix is not None:
            # R, C (unless skipped) and sum(R), from every rank's sums: the same on all.
            moments = {k: step.state[k] for k in ("exp_avg_sq_row", "exp_avg_sq_col")}
            _run(factored_moments_op, step, workspace=workspace, **moments)
            if step.grad.numel():
                _run(
                    factored_norm_op,
                    step,
                    grad=step.grad.reshape(-1),
                    workspace=workspace,
                    offset=step.shard.offset,
                    **moments,
                )
        second.append(stats[U_SUMSQ])  # a 1-D slice's: pass A1's
    u_sumsqs = torch.stack(second).to(F64)
    all_reduce_sum_(u_sumsqs)

    # Phase 3: the write-back (and a 1-D slice's v), with the whole parameter's sums.
    for i, (step, workspace) in enumerate(zip(steps, workspaces, strict=True)):
        local = step.shard.local.reshape(-1)
        if not local.numel():
            continue
        stats_slots(workspace)[U_SUMSQ] = u_sumsqs[i].to(torch.float32)
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
