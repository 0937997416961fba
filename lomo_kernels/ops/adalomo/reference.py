"""Pure-PyTorch AdaLomo passes: the executable specification, on any device.

All math is fp32 (tile sums in float64). Tensors are visited in bounded tiles (at most
`CHUNK` elements), so no fp32 copy of a whole parameter or gradient is ever made; vectors
(moments, row/column sums) are small and handled whole. Nothing here reads a tensor value
on the host: skip decisions are `torch.where` selects on the device.

Per element: ``h = fp32(grad) * inv_scale`` (non-finite h marks the parameter as skipped
and raises found_inf), ``g = clamp(h, -clip_value, clip_value) * clip_coef``,
``u = g*g + eps0``. Factored ([rows, cols]): ``R = b*R + (1-b)*mean_j u``, C likewise over i,
``update = g * rsqrt(R_i / mean(R)) * rsqrt(C_j)``. 1-D: ``v = b*v + (1-b)*u``,
``update = g * rsqrt(v)``. Then ``lr_t = lr * max(eps1, rms(p))``,
``p = p * (1 - lr_t*wd) - lr_t / max(1, rms(update)/clip_threshold) * update``.

Factored tensors take the coefficient out of pass A, so that pass A can also measure
``sum(h^2)`` (G_SUMSQ), from which a caller may compute clip_coef itself (single_backward):
pass A sums ``k = clamp(h, +-clip_value)^2`` per row and column, and the moments pass forms
``mean_j u = clip_coef * (clip_coef * mean_j k) + eps0`` (0 for the product when clip_coef is
0, so an overflowed sum cannot turn into nan).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ...core.rounding import NEAREST, Rounding, round_to_dtype
from ...core.scalars import value_of
from .workspace import G_SUMSQ, NUM_SLOTS, P_SUMSQ, R_SUM, SKIP, U_SUMSQ, stats_slots

# Elements per tile: large enough to amortise per-op overhead, small enough to bound the
# fp32 temporaries (a few of 256 KiB each).
CHUNK = 1 << 16

# Each tile's sums are taken in float64 and rounded once into the fp32 workspace, so the
# result does not depend on the order the CPU's vectorised reduction adds in.
F64 = torch.float64


def _tiles(rows: int, cols: int) -> Iterator[tuple[int, int, int, int]]:
    """(r0, r1, c0, c1) tiles of at most CHUNK elements covering a [rows, cols] matrix."""
    cols_per = min(cols, CHUNK)
    rows_per = max(1, CHUNK // cols_per)
    for r0 in range(0, rows, rows_per):
        for c0 in range(0, cols, cols_per):
            yield r0, min(r0 + rows_per, rows), c0, min(c0 + cols_per, cols)


def _spans(n: int) -> Iterator[tuple[int, int]]:
    for start in range(0, n, CHUNK):
        yield start, min(start + CHUNK, n)


class GradTransform:
    """Turns stored gradient values into the fp32 g of the math (scalars resolved once)."""

    def __init__(
        self,
        inv_scale: torch.Tensor | None,
        clip_value: float | None,
        clip_coef: torch.Tensor | None,
    ) -> None:
        self.inv_scale = None if inv_scale is None else value_of(inv_scale)
        self.clip_value = clip_value
        self.clip_coef = None if clip_coef is None else value_of(clip_coef)

    def scaled(self, grad: torch.Tensor) -> torch.Tensor:
        """h = fp32(grad) * inv_scale of one tile."""
        h = grad.to(torch.float32)
        return h if self.inv_scale is None else h * self.inv_scale

    def clamped(self, h: torch.Tensor) -> torch.Tensor:
        """h clamped to +-clip_value (the coefficient not applied)."""
        return h if self.clip_value is None else h.clamp(-self.clip_value, self.clip_value)

    def __call__(self, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(g, finite mask of grad * inv_scale) for one tile."""
        h = self.scaled(grad)
        g = self.clamped(h)
        if self.clip_coef is not None:
            g = g * self.clip_coef
        return g, torch.isfinite(h)


def _skip_on_entry(stats: torch.Tensor, skip_if: torch.Tensor | None) -> torch.Tensor:
    skip = stats[SKIP] != 0
    if skip_if is not None:
        skip = skip | (skip_if.reshape(-1)[0] != 0)
    return skip


def _record_flags(
    stats: torch.Tensor, found_inf: torch.Tensor | None, skip_in: torch.Tensor, bad: torch.Tensor
) -> None:
    """SKIP |= skip_in | bad; found_inf raised to 1 on bad unless skipped on entry."""
    stats[SKIP] = torch.where(skip_in | bad, torch.ones_like(stats[SKIP]), stats[SKIP])
    if found_inf is not None:
        raise_it = bad & ~skip_in
        flat = found_inf.view(-1)
        flat.copy_(torch.where(raise_it, torch.clamp(flat, min=1.0), flat))


def step_scalars(
    p_sumsq: torch.Tensor,
    u_sumsq: torch.Tensor,
    numel: int,
    lr: torch.Tensor,
    eps1: float,
    clip_threshold: float,
    weight_decay: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, decay): lr_t / max(1, rms(update) / clip_threshold) and 1 - lr_t * wd, from
    the whole tensor's sums of p^2 and update^2 (fp32)."""
    lr_eff = value_of(lr)
    p_rms = torch.sqrt(p_sumsq / numel)
    lr_t = lr_eff * torch.clamp(p_rms, min=eps1)
    u_rms = torch.sqrt(u_sumsq / numel)
    scale = lr_t / torch.clamp(u_rms / clip_threshold, min=1.0)
    return scale, 1.0 - lr_t * weight_decay


def _write_back_scalars(
    workspace: torch.Tensor,
    numel: int,
    lr: torch.Tensor,
    eps1: float,
    clip_threshold: float,
    weight_decay: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(skip, scale, decay) of a write-back pass (C, C1), from the workspace's sums."""
    stats = stats_slots(workspace)
    scale, decay = step_scalars(
        stats[P_SUMSQ], stats[U_SUMSQ], numel, lr, eps1, clip_threshold, weight_decay
    )
    return stats[SKIP] != 0, scale, decay


def store_rounded(
    param_tile: torch.Tensor,
    new: torch.Tensor,
    skip: torch.Tensor,
    rounding: Rounding = NEAREST,
    index: torch.Tensor | None = None,
) -> None:
    """Writes fp32 `new` into `param_tile` in its dtype unless `skip`; `index`: the tile's
    flat element indices in the whole parameter (needed when `rounding` is stochastic)."""
    random16 = None if index is None else rounding.random16(index)
    rounded = round_to_dtype(new, param_tile.dtype, random16)
    param_tile.copy_(torch.where(skip, param_tile, rounded))


def tile_index(r0: int, r1: int, c0: int, c1: int, cols: int, device: torch.device) -> torch.Tensor:
    """Flat element indices of tile [r0:r1, c0:c1] of a [*, cols] matrix (int64)."""
    rows = torch.arange(r0, r1, device=device, dtype=torch.int64)
    columns = torch.arange(c0, c1, device=device, dtype=torch.int64)
    return rows[:, None] * cols + columns[None, :]


# ----------------------------------------------------------------------------- factored


def row_pieces(offset: int, n: int, cols: int) -> Iterator[tuple[int, int, int, int, int]]:
    """Splits flat elements [offset, offset + n) of a [*, cols] matrix into 2-D pieces.

    Yields (start in the slice, first row, rows, first column, columns): a partial first row,
    whole rows, a partial last row (each present only when non-empty); each piece is
    contiguous in the slice.
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


@dataclass(frozen=True)
class SliceTile:
    """A tile of at most CHUNK elements of a flat slice of a [rows, cols] matrix: rows
    [r0, r1) and columns [c0, c1) of the matrix, inside one piece of `row_pieces` (its
    elements `span` of the slice, `width` columns from `piece_col`)."""

    span: slice
    width: int
    piece_row: int
    piece_col: int
    r0: int
    r1: int
    c0: int
    c1: int

    def of(self, flat: torch.Tensor) -> torch.Tensor:
        """This tile of a flat tensor holding the slice's elements (a view)."""
        piece = flat[self.span].view(-1, self.width)
        return piece[self.r0 - self.piece_row : self.r1 - self.piece_row,
                     self.c0 - self.piece_col : self.c1 - self.piece_col]  # fmt: skip

    def index(self, cols: int, device: torch.device) -> torch.Tensor:
        """The tile's flat element indices in the whole matrix."""
        return tile_index(self.r0, self.r1, self.c0, self.c1, cols, device)


def slice_tiles(offset: int, n: int, cols: int) -> Iterator[SliceTile]:
    """Tiles of at most CHUNK elements covering flat elements [offset, offset + n) of a
    [*, cols] matrix; the whole matrix (offset 0) in `_tiles`' order."""
    for start, row, rows, col, width in row_pieces(offset, n, cols):
        span = slice(start, start + rows * width)
        for r0, r1, c0, c1 in _tiles(rows, width):
            yield SliceTile(span, width, row, col, row + r0, row + r1, col + c0, col + c1)


def factored_stats_(
    grad: torch.Tensor,
    param: torch.Tensor,
    workspace: torch.Tensor,
    found_inf: torch.Tensor | None,
    skip_if: torch.Tensor | None,
    cols: int,
    inv_scale: torch.Tensor | None,
    clip_value: float | None,
    offset: int,
) -> None:
    """Pass A: row and column sums of k = clamp(h)^2, sum of h^2, sum of p^2, non-finite flag,
    over the slice `grad` (and `param`) at flat `offset` of the [rows, cols] matrix the
    workspace holds the sums of (its rows: the workspace's length less cols and the slots)."""
    rows = workspace.numel() - cols - NUM_SLOTS
    row_acc, col_acc = workspace[:rows], workspace[rows : rows + cols]
    stats = stats_slots(workspace)
    skip_in = _skip_on_entry(stats, skip_if)
    transform = GradTransform(inv_scale, clip_value, None)
    bad = torch.zeros((), dtype=torch.bool, device=grad.device)
    g_flat, p_flat = grad.reshape(-1), param.reshape(-1)
    for tile in slice_tiles(offset, g_flat.numel(), cols):
        h = transform.scaled(tile.of(g_flat))
        h64 = h.to(F64)  # squared in float64, as ops.grad_sumsq_ measures it
        stats[G_SUMSQ] += (h64 * h64).sum()
        g = transform.clamped(h)
        k = g * g
        row_acc[tile.r0 : tile.r1] += k.sum(dim=1, dtype=F64)
        col_acc[tile.c0 : tile.c1] += k.sum(dim=0, dtype=F64)
        p = tile.of(p_flat).to(torch.float32)
        stats[P_SUMSQ] += (p * p).sum(dtype=F64)
        bad = bad | ~torch.isfinite(h).all()
    _record_flags(stats, found_inf, skip_in, bad)


def mean_u(acc: torch.Tensor, count: int, coef: torch.Tensor | None, eps0: float) -> torch.Tensor:
    """Mean of u = (c*g)^2 + eps0 from `acc`, the sum of g^2 over `count` elements.

    ``c * (c * m)``, not ``(c * c) * m``: c is small only when the sums are large, and c*c
    alone could underflow. c == 0 gives 0 even for an overflowed (inf) m.
    """
    m = acc / count
    if coef is not None:
        m = coef * (coef * torch.where(coef == 0, torch.zeros_like(m), m))
    return m + eps0


def update_moment_(
    state: torch.Tensor, mean: torch.Tensor, b: torch.Tensor | float, skip: torch.Tensor
) -> None:
    """state = b * state + (1 - b) * mean, unless `skip`."""
    state.copy_(torch.where(skip, state, state * b + mean * (1.0 - b)))


def factored_moments_(
    exp_avg_sq_row: torch.Tensor,
    exp_avg_sq_col: torch.Tensor,
    workspace: torch.Tensor,
    beta2: torch.Tensor,
    clip_coef: torch.Tensor | None,
    eps0: float,
) -> None:
    """R = b*R + (1-b)*row_mean(u), C = b*C + (1-b)*col_mean(u) unless skipped; R_SUM = sum(R)."""
    rows, cols = exp_avg_sq_row.numel(), exp_avg_sq_col.numel()
    stats = stats_slots(workspace)
    skip = stats[SKIP] != 0
    b = value_of(beta2)
    coef = None if clip_coef is None else value_of(clip_coef)
    for state, acc, count in (
        (exp_avg_sq_row, workspace[:rows], cols),
        (exp_avg_sq_col, workspace[rows : rows + cols], rows),
    ):
        update_moment_(state, mean_u(acc, count, coef, eps0), b, skip)
    stats[R_SUM] = exp_avg_sq_row.sum(dtype=F64)


def moment_factors(
    exp_avg_sq_row: torch.Tensor, exp_avg_sq_col: torch.Tensor, row_sum: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(r, c): rsqrt(R / mean(R)) and rsqrt(C), `row_sum` the fp32 sum of R; vectors, not
    tensor-sized."""
    mean = row_sum / exp_avg_sq_row.numel()
    return torch.rsqrt(exp_avg_sq_row / mean), torch.rsqrt(exp_avg_sq_col)


def _factored_updates(
    grad: torch.Tensor,
    exp_avg_sq_row: torch.Tensor,
    exp_avg_sq_col: torch.Tensor,
    workspace: torch.Tensor,
    inv_scale: torch.Tensor | None,
    clip_value: float | None,
    clip_coef: torch.Tensor | None,
    offset: int,
) -> Iterator[tuple[SliceTile, torch.Tensor]]:
    """(tile, r_i * c_j * g_ij) per tile of the slice `grad` at flat `offset` of the
    moments' [rows, cols] matrix (passes B and C)."""
    cols = exp_avg_sq_col.numel()
    r, c = moment_factors(exp_avg_sq_row, exp_avg_sq_col, stats_slots(workspace)[R_SUM])
    transform = GradTransform(inv_scale, clip_value, clip_coef)
    flat = grad.reshape(-1)
    for tile in slice_tiles(offset, flat.numel(), cols):
        g, _ = transform(tile.of(flat))
        yield tile, (r[tile.r0 : tile.r1, None] * c[None, tile.c0 : tile.c1]) * g


def factored_norm_(
    grad: torch.Tensor,
    exp_avg_sq_row: torch.Tensor,
    exp_avg_sq_col: torch.Tensor,
    workspace: torch.Tensor,
    inv_scale: torch.Tensor | None,
    clip_value: float | None,
    clip_coef: torch.Tensor | None,
    offset: int,
) -> None:
    """Pass B: U_SUMSQ += sum((r_i * c_j * g_ij)^2) over the slice `grad` at flat `offset`."""
    stats = stats_slots(workspace)
    for _, update in _factored_updates(
        grad, exp_avg_sq_row, exp_avg_sq_col, workspace, inv_scale, clip_value, clip_coef, offset
    ):
        stats[U_SUMSQ] += (update * update).sum(dtype=F64)


def factored_apply_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg_sq_row: torch.Tensor,
    exp_avg_sq_col: torch.Tensor,
    workspace: torch.Tensor,
    lr: torch.Tensor,
    eps1: float,
    clip_threshold: float,
    weight_decay: float,
    inv_scale: torch.Tensor | None,
    clip_value: float | None,
    clip_coef: torch.Tensor | None,
    stochastic_rounding: bool,
    seed: int,
    seed_step: torch.Tensor | None,
    offset: int,
) -> None:
    """Pass C: p = p * decay - scale * r_i * c_j * g_ij over the slice `param` at flat
    `offset`, unless skipped; the rms values are the whole matrix's (rows * cols elements),
    rounded as `Rounding` says, keyed by the flat index in the whole matrix."""
    n_cols = exp_avg_sq_col.numel()
    skip, scale, decay = _write_back_scalars(
        workspace, exp_avg_sq_row.numel() * n_cols, lr, eps1, clip_threshold, weight_decay
    )
    rounding = Rounding(param.dtype, stochastic_rounding, seed, seed_step)
    flat = param.view(-1)
    for place, update in _factored_updates(
        grad, exp_avg_sq_row, exp_avg_sq_col, workspace, inv_scale, clip_value, clip_coef, offset
    ):
        tile = place.of(flat)
        index = place.index(n_cols, param.device) if rounding.stochastic else None
        new = tile.to(torch.float32) * decay - scale * update
        store_rounded(tile, new, skip, rounding, index)


# ----------------------------------------------------------------------------- 1-D


def vector_update(
    transform: GradTransform,
    grad: torch.Tensor,
    v: torch.Tensor,
    b: torch.Tensor | float,
    eps0: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(update, new v, finite mask) of one span of a 1-D tensor (v not written)."""
    g, finite = transform(grad)
    v_new = v * b + (g * g + eps0) * (1.0 - b)
    return torch.rsqrt(v_new) * g, v_new, finite


def _vector_updates(
    grad: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    beta2: torch.Tensor,
    eps0: float,
    inv_scale: torch.Tensor | None,
    clip_value: float | None,
    clip_coef: torch.Tensor | None,
) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(span, update, new v, finite mask) per span of a 1-D tensor (passes A1 and C1)."""
    transform = GradTransform(inv_scale, clip_value, clip_coef)
    b = value_of(beta2)
    g1, v1 = grad.view(-1), exp_avg_sq.view(-1)
    for s0, s1 in _spans(g1.numel()):
        yield slice(s0, s1), *vector_update(transform, g1[s0:s1], v1[s0:s1], b, eps0)


def vector_stats_(
    grad: torch.Tensor,
    param: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    workspace: torch.Tensor,
    found_inf: torch.Tensor | None,
    skip_if: torch.Tensor | None,
    beta2: torch.Tensor,
    eps0: float,
    inv_scale: torch.Tensor | None,
    clip_value: float | None,
    clip_coef: torch.Tensor | None,
) -> None:
    """Pass A1: U_SUMSQ += sum(g^2 / v_new), P_SUMSQ += sum(p^2); v itself is not written."""
    stats = stats_slots(workspace)
    skip_in = _skip_on_entry(stats, skip_if)
    p1 = param.view(-1)
    bad = torch.zeros((), dtype=torch.bool, device=grad.device)
    for span, update, _, finite in _vector_updates(
        grad, exp_avg_sq, beta2, eps0, inv_scale, clip_value, clip_coef
    ):
        stats[U_SUMSQ] += (update * update).sum(dtype=F64)
        p = p1[span].to(torch.float32)
        stats[P_SUMSQ] += (p * p).sum(dtype=F64)
        bad = bad | ~finite.all()
    _record_flags(stats, found_inf, skip_in, bad)


def vector_apply_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    workspace: torch.Tensor,
    beta2: torch.Tensor,
    eps0: float,
    lr: torch.Tensor,
    eps1: float,
    clip_threshold: float,
    weight_decay: float,
    inv_scale: torch.Tensor | None,
    clip_value: float | None,
    clip_coef: torch.Tensor | None,
    stochastic_rounding: bool,
    seed: int,
    seed_step: torch.Tensor | None,
    offset: int,
    full_numel: int,
) -> None:
    """Pass C1: v = v_new and p = p * decay - scale * g * rsqrt(v_new), unless skipped;
    rounded as `Rounding` says. `param` (and grad, v) hold elements [offset, offset + numel)
    of a vector of `full_numel`: the rms values are its, the rounding keyed by the index in
    it."""
    skip, scale, decay = _write_back_scalars(
        workspace, full_numel, lr, eps1, clip_threshold, weight_decay
    )
    rounding = Rounding(param.dtype, stochastic_rounding, seed, seed_step)
    p1, v1 = param.view(-1), exp_avg_sq.view(-1)
    for span, update, v_new, _ in _vector_updates(
        grad, exp_avg_sq, beta2, eps0, inv_scale, clip_value, clip_coef
    ):
        tile = p1[span]
        index = None
        if rounding.stochastic:
            index = offset + torch.arange(
                span.start, span.stop, device=param.device, dtype=torch.int64
            )
        new = tile.to(torch.float32) * decay - scale * update
        store_rounded(tile, new, skip, rounding, index)
        v1[span] = torch.where(skip, v1[span], v_new)
