"""AdaLomo on slices of parameters: the statistics that span ranks, reduced across them.

A rank owns a flat slice ``[offset, offset + n)`` of each parameter, which for a matrix
[rows, cols] cuts across rows. AdaLomo needs, per parameter: the row and column sums of
``g*g`` before the clip coefficient (factored, >= 2 dims; the coefficient and eps0 are
applied to the means, as by the reference's moments pass), ``sum(update^2)`` and
``sum(p^2)`` over the whole tensor, and whether any gradient element is non-finite. Each
rank adds up its slice's share; per batch of slices (a reduce-scatter bucket, an FSDP2 unit)
two small all-reduces, asked of the sharding (the row/column sums and flags, then the update
sums, which need the new moments), give every rank the single-process totals, so the moments
R [rows] and C [cols], replicated on every rank, stay identical everywhere, and 1-D moments v
live with their slice. The math is the reference passes' own (`ops.adalomo.reference`:
moments, factors, step scalars and rounding), here applied to slices in fp32 blocks of at
most CHUNK elements; this module adds only the slicing and the partial sums.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ..core.rounding import NEAREST, Rounding
from ..distributed.shard import Shard
from ..ops.adalomo.reference import (
    CHUNK,
    GradTransform,
    mean_u,
    moment_factors,
    step_scalars,
    store_rounded,
    update_moment_,
    vector_update,
)


@dataclass
class SliceStep:
    """One parameter slice's step: its reduced gradient, its moments and the scalars."""

    shard: Shard
    grad: torch.Tensor
    state: dict[str, torch.Tensor]
    lr: torch.Tensor
    beta2: float
    eps: tuple[float, float]
    clip_threshold: float
    weight_decay: float
    transform: GradTransform
    skip: torch.Tensor | None = None  # non-zero: this slice's parameter is not updated
    rounding: Rounding = NEAREST  # keyed by the flat index in the whole parameter


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


def row_pieces(offset: int, n: int, cols: int) -> Iterator[tuple[int, int, int, int, int]]:
    """Splits flat elements [offset, offset + n) of a [*, cols] matrix into 2-D blocks.

    Yields (start in the slice, first row, rows, first column, columns): a partial first row,
    whole rows, a partial last row (each present only when non-empty).
    """
    pos, end = offset, offset + n
    while pos < end:
        row, col = divmod(pos, cols)
        if col or end - pos < cols:
            width = min(cols - col, end - pos)
            yield pos - offset, row, 1, col, width
            pos += width
        else:
            rows = (end - pos) // cols
            yield pos - offset, row, rows, 0, cols
            pos += rows * cols


def _factored(step: SliceStep) -> bool:
    return len(step.shard.full_shape) >= 2


def _pieces(step: SliceStep) -> Iterator[tuple[slice, int, int, int, int]]:
    """The slice in blocks of at most CHUNK elements: (span in the slice, first row, rows,
    first column, columns); a 1-D parameter's blocks are single rows."""
    n = step.grad.numel()
    if not _factored(step):
        for start in range(0, n, CHUNK):
            width = min(CHUNK, n - start)
            yield slice(start, start + width), 0, 1, start, width
        return
    cols = step.shard.full_shape[-1]
    per = max(1, CHUNK // cols)
    for start, row, nrows, col, width in row_pieces(step.shard.offset, n, cols):
        for r0 in range(0, nrows, per):
            rows = min(per, nrows - r0)
            begin = start + r0 * width
            yield slice(begin, begin + rows * width), row + r0, rows, col, width


def _factors(step: SliceStep) -> tuple[torch.Tensor, torch.Tensor]:
    """(r, c) of the whole parameter from its (new) moments R and C."""
    big_r, big_c = step.state["exp_avg_sq_row"], step.state["exp_avg_sq_col"]
    return moment_factors(big_r, big_c, big_r.sum(dtype=torch.float64).to(torch.float32))


def _block_updates(
    step: SliceStep, skip: torch.Tensor, write_moments: bool
) -> Iterator[tuple[slice, torch.Tensor]]:
    """(span in the slice, unnormalised update) of each block, from the new moments: R and C
    already written, a 1-D slice's v computed here and, with `write_moments`, stored unless
    `skip`."""
    grad = step.grad.reshape(-1)
    if _factored(step):
        r, c = _factors(step)
    for span, row, nrows, col, width in _pieces(step):
        if _factored(step):
            g, _ = step.transform(grad[span])
            factors = r[row : row + nrows, None] * c[None, col : col + width]
            yield span, (factors * g.view(nrows, width)).reshape(-1)
            continue
        v = step.state["exp_avg_sq"][span]
        update, v_new, _ = vector_update(step.transform, grad[span], v, step.beta2, step.eps[0])
        if write_moments:
            v.copy_(torch.where(skip, v, v_new))
        yield span, update


def _first_sums(step: SliceStep) -> torch.Tensor:
    """This rank's share of [row sums, col sums of clamp(h)^2] (factored) + [sum p^2,
    non-finite count]."""
    device = step.grad.device
    tail = torch.zeros(2, dtype=torch.float64, device=device)
    rows = cols = 0
    if _factored(step):
        cols = step.shard.full_shape[-1]
        rows = step.shard.full_numel // cols
    sums = torch.zeros(rows + cols, dtype=torch.float64, device=device)
    grad, local = step.grad.reshape(-1), step.shard.local
    for span, row, nrows, col, width in _pieces(step):
        h = step.transform.scaled(grad[span])
        p = local[span].to(torch.float32)
        tail[0] += (p * p).sum(dtype=torch.float64)
        tail[1] += (~torch.isfinite(h)).sum(dtype=torch.float64)
        if rows:
            g = step.transform.clamped(h)
            block = (g * g).view(nrows, width)
            sums[row : row + nrows] += block.sum(dim=1, dtype=torch.float64)
            sums[rows + col : rows + col + width] += block.sum(dim=0, dtype=torch.float64)
    return torch.cat([sums, tail])


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
    raises `found_inf`. Each phase walks the slices in blocks of at most CHUNK elements,
    recomputing g (and the update) from the gradient, so the fp32 temporaries stay a few
    blocks in size whatever the parameter.
    """
    if not steps:
        return
    device = steps[0].grad.device
    skip_in = skip_if.reshape(-1)[0] != 0
    totals = torch.cat([_first_sums(step) for step in steps])
    all_reduce_sum_(totals)

    # Phase 2: new R and C (identical on every rank), then this rank's sum of update^2.
    at = 0
    skips, p_sumsqs, second = [], [], []
    for step in steps:
        if _factored(step):
            cols = step.shard.full_shape[-1]
            rows = step.shard.full_numel // cols
            # As in the workspace: fp32 sums, the reference's means of u.
            sums = totals[at : at + rows + cols].to(torch.float32)
            coef, eps0 = step.transform.clip_coef, step.eps[0]
            row_mean = mean_u(sums[:rows], cols, coef, eps0)
            col_mean = mean_u(sums[rows:], rows, coef, eps0)
            at += rows + cols
        p_sumsq, bad = totals[at], totals[at + 1] > 0
        at += 2
        skip = skip_in | bad
        if step.skip is not None:
            skip = skip | (step.skip.reshape(-1)[0] != 0)
        flag = found_inf.view(-1)
        flag.copy_(torch.where(bad & ~skip_in, torch.clamp(flag, min=1.0), flag))
        if _factored(step):
            update_moment_(step.state["exp_avg_sq_row"], row_mean, step.beta2, skip)
            update_moment_(step.state["exp_avg_sq_col"], col_mean, step.beta2, skip)
        # A skipped slice's moments keep their old values; its update is never written.
        u_sumsq = torch.zeros((), dtype=torch.float64, device=device)
        for _, update in _block_updates(step, skip, write_moments=False):
            u_sumsq += (update * update).sum(dtype=torch.float64)
        skips.append(skip)
        p_sumsqs.append(p_sumsq)
        second.append(u_sumsq)
    u_sumsqs = torch.stack(second)
    all_reduce_sum_(u_sumsqs)

    # Phase 3: the write-back (and a 1-D slice's v), with the whole parameter's RMS values.
    for i, step in enumerate(steps):
        local = step.shard.local
        if not local.numel():
            continue
        scale, decay = step_scalars(
            p_sumsqs[i].to(torch.float32),
            u_sumsqs[i].to(torch.float32),
            step.shard.full_numel,
            step.lr,
            step.eps[1],
            step.clip_threshold,
            step.weight_decay,
        )
        for span, update in _block_updates(step, skips[i], write_moments=True):
            index = None
            if step.rounding.stochastic:
                first = step.shard.offset + span.start
                index = torch.arange(first, first + update.numel(), device=local.device)
            new = local[span].to(torch.float32) * decay - scale * update
            store_rounded(local[span], new, skips[i], step.rounding, index)
