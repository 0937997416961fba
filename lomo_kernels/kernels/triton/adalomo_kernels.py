"""Triton kernels of the fused AdaLomo passes (one launch per pass).

Factored tensors ([rows, cols]) run on 2-D tiles: program (pid_n, pid_m) owns a block of
BLOCK_N columns and a contiguous group of rows, walked BLOCK_M rows at a time. Column blocks
are grid axis 0 (unbounded); row groups, few by construction, are axis 1 (at most 65535).
Row partial sums are added atomically per tile row; column partials stay in registers over
the whole row group and are added atomically once. 1-D tensors run on flat blocks.

All math is fp32 and all offsets int64. Runtime values (sizes, lr, beta2, scales, clip
values, the rounding seed and its per-step part) are kernel arguments; `tl.constexpr` only
selects code paths and tile shapes. Loads and roundings are `rounding_kernels.py`'s, as the
LOMO update's: bf16 travels as int16 bit patterns and is rounded on the bits (the
interpreter's fp32 -> bf16 cast truncates), to nearest even or, in the write-back passes,
stochastically (bf16 and fp16) from the element's flat index in the whole parameter, so the
interpreter and the GPU write the same values.

The workspace layout is the one of `lomo_kernels.ops.adalomo.workspace`: row sums, column sums,
then the P_SUMSQ, U_SUMSQ, G_SUMSQ, SKIP, R_SUM slots.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .runtime import interpret_mode, kernels

# Slot offsets after the row/column sums (ops.adalomo.workspace.P_SUMSQ etc.).
P_SUMSQ = tl.constexpr(0)
U_SUMSQ = tl.constexpr(1)
G_SUMSQ = tl.constexpr(2)
SKIP = tl.constexpr(3)
R_SUM = tl.constexpr(4)


# triton.jit picks interpreter or compiler when a kernel is decorated (runtime.kernels).
DECORATED_FOR_INTERPRETER = interpret_mode()
# The shared loads, gradient, hash and roundings, decorated for the same mode as this module.
_shared = kernels("rounding_kernels")
_rounding_key, _to_storage = _shared.rounding_key, _shared.to_storage
_load_fp32, _factor = _shared.load_fp32, _shared.factor
_grad_source, _scaled, _clamp, _grad = (
    _shared.grad_source,
    _shared.scaled_grad,
    _shared.clamp,
    _shared.gradient,
)


# ----------------------------------------------------------------------------- building blocks


@triton.jit
def _beta(beta2_ptr):
    """(b, 1 - b) in fp32 from the device beta2."""
    b = tl.load(beta2_ptr)
    return b, 1.0 - b


@triton.jit
def _mean_u(acc, count, coef, eps0):
    """Mean of u = (coef*g)^2 + eps0 from the sum `acc` of g^2 over `count` elements:
    coef * (coef * mean) (coef*coef alone could underflow), 0 when coef is 0."""
    m = tl.where(coef == 0, 0.0, acc / count)
    return coef * (coef * m) + eps0


@triton.jit
def _runs(stats_ptr, skip_if_ptr):
    """True unless the SKIP slot or the caller's skip_if is non-zero (NaN skips too)."""
    run = tl.load(stats_ptr + SKIP) == 0
    if skip_if_ptr is not None:
        run = run & (tl.load(skip_if_ptr) == 0)
    return run


@triton.jit
def _raise_flags(stats_ptr, found_inf_ptr, bad):
    if bad > 0:
        tl.atomic_max(stats_ptr + SKIP, 1.0)
        if found_inf_ptr is not None:
            tl.atomic_max(found_inf_ptr, 1.0)


@triton.jit
def _write_back(param_ptr, stats_ptr, numel_f, step, rounding, STOCHASTIC_ROUNDING: tl.constexpr):
    """What a write-back pass (C, C1) applies every update with: (param_ptr, scale, decay,
    rounding key), scale = lr_t / max(1, rms(update) / clip_threshold) and
    decay = 1 - lr_t * wd from the workspace sums, step = (lr_ptr, eps1, clip_threshold,
    weight_decay), rounding = (seed_lo, seed_hi, seed_step_ptr) (`rounding_key`)."""
    lr_ptr, eps1, clip_threshold, weight_decay = step
    lr_t = tl.load(lr_ptr) * tl.maximum(tl.sqrt_rn(tl.load(stats_ptr + P_SUMSQ) / numel_f), eps1)
    u_rms = tl.sqrt_rn(tl.load(stats_ptr + U_SUMSQ) / numel_f)
    scale = lr_t / tl.maximum(u_rms / clip_threshold, 1.0)
    decay = 1.0 - lr_t * weight_decay
    seed_lo, seed_hi, seed_step_ptr = rounding
    key = _rounding_key(seed_lo, seed_hi, seed_step_ptr, STOCHASTIC_ROUNDING)
    return param_ptr, scale, decay, key


@triton.jit
def _apply(
    write_back,
    update,
    offs,
    index,
    mask,
    PARAM_KIND: tl.constexpr,
    STOCHASTIC_ROUNDING: tl.constexpr,
):
    """p = p * decay - scale * update at the offsets `offs` of the parameter's pointer
    (`_write_back`), stored in its dtype, rounded to nearest even or stochastically under the
    key with the bits of flat indices `index` in the whole parameter
    (`rounding_kernels.to_storage`)."""
    param_ptr, scale, decay, key = write_back
    new = _load_fp32(param_ptr, offs, mask, PARAM_KIND) * decay - scale * update
    out = _to_storage(new, index, key, PARAM_KIND, STOCHASTIC_ROUNDING)
    tl.store(param_ptr + offs, out, mask=mask)


@triton.jit
def _row_group(rows, rows_per_prog, first_row, BLOCK_M: tl.constexpr):
    """(first row, end row, iterations) of this program's row group; the grid's rows start
    at `first_row` and end at `rows`."""
    row_start = first_row + tl.program_id(1).to(tl.int64) * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, rows)
    return row_start, row_end, tl.cdiv(row_end - row_start, BLOCK_M)


@triton.jit
def _column_block(cols, BLOCK_N: tl.constexpr):
    """(column indices, mask) of this program's column block."""
    cols_idx = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    return cols_idx, cols_idx < cols


@triton.jit
def _slice_rows(offset, n, cols, rows_per_prog, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(rows, iterations) of this program's tiles of the flat elements [offset, offset + n)
    of a [*, cols] matrix, which a pass's tensors hold from their element 0: rows holds the
    row group (of the rows the slice touches), the column block and the slice's bounds, as
    `_slice_tile` reads them."""
    begin = offset.to(tl.int64)
    end = begin + n
    row_start, row_end, n_iter = _row_group(
        (end + cols - 1) // cols, rows_per_prog, begin // cols, BLOCK_M
    )
    cols_idx, col_mask = _column_block(cols, BLOCK_N)
    return (row_start, row_end, cols, cols_idx, col_mask, begin, end), n_iter


@triton.jit
def _slice_tile(rows, it, BLOCK_M: tl.constexpr):
    """(row indices, row mask, flat indices in the matrix, offsets in the tensors, mask) of
    tile `it` ([BLOCK_M, BLOCK_N]) of `_slice_rows`' rows: the mask holds the slice's
    elements only."""
    row_start, row_end, cols, cols_idx, col_mask, begin, end = rows
    rows_idx = row_start + it * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows_idx < row_end
    index = rows_idx[:, None] * cols + cols_idx[None, :]
    mask = row_mask[:, None] & col_mask[None, :] & (index >= begin) & (index < end)
    return rows_idx, row_mask, index, index - begin, mask


@triton.jit
def _vector_block(n, BLOCK: tl.constexpr):
    """(offsets, mask) of this program's block of a 1-D tensor."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    return offs, offs < n


# ----------------------------------------------------------------------------- factored


@triton.jit(do_not_specialize=["offset", "n"])
def factored_stats_kernel(
    grad_ptr,
    param_ptr,
    ws_ptr,
    found_inf_ptr,
    skip_if_ptr,
    rows,
    cols,
    offset,
    n,
    rows_per_prog,
    inv_scale_ptr,
    clip_value,
    GRAD_KIND: tl.constexpr,
    PARAM_KIND: tl.constexpr,
    HAS_CLIP_VALUE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Pass A: row/column sums of g^2 (g clamped, no clip coefficient), sum of
    h^2 = (grad * inv_scale)^2, sum of p^2, non-finite flag, over the flat elements
    [offset, offset + n) of the [rows, cols] matrix, which grad (and param) hold from their
    element 0; the grid's row groups are of the rows the slice touches."""
    stats_ptr = ws_ptr + rows + cols
    if _runs(stats_ptr, skip_if_ptr):
        inv_scale = _factor(inv_scale_ptr)
        tile_rows, n_iter = _slice_rows(offset, n, cols, rows_per_prog, BLOCK_M, BLOCK_N)
        cols_idx, col_mask = tile_rows[3], tile_rows[4]
        col_sum = tl.zeros([BLOCK_N], dtype=tl.float32)
        p_sum = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        # Per row (reduced within the tile rows each iteration): a second tile-sized
        # accumulator would take the clip-by-value variants to the register limit.
        h_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        bad = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
        for it in range(0, n_iter):
            rows_idx, row_mask, _, offs, mask = _slice_tile(tile_rows, it, BLOCK_M)
            h, finite = _scaled(grad_ptr, inv_scale, offs, mask, GRAD_KIND)
            g = _clamp(h, clip_value, HAS_CLIP_VALUE)
            k = tl.where(mask, g * g, 0.0)
            tl.atomic_add(ws_ptr + rows_idx, tl.sum(k, axis=1), mask=row_mask, sem="relaxed")
            col_sum += tl.sum(k, axis=0)
            if HAS_CLIP_VALUE:  # else h*h is k, already summed in col_sum
                h_sum += tl.sum(tl.where(mask, h * h, 0.0), axis=1)
            p = _load_fp32(param_ptr, offs, mask, PARAM_KIND)
            p_sum += p * p
            bad = tl.maximum(bad, (~finite).to(tl.int32))
        tl.atomic_add(ws_ptr + rows + cols_idx, col_sum, mask=col_mask, sem="relaxed")
        tl.atomic_add(stats_ptr + P_SUMSQ, tl.sum(p_sum), sem="relaxed")
        if HAS_CLIP_VALUE:
            tl.atomic_add(stats_ptr + G_SUMSQ, tl.sum(h_sum), sem="relaxed")
        else:
            tl.atomic_add(stats_ptr + G_SUMSQ, tl.sum(col_sum), sem="relaxed")
        _raise_flags(stats_ptr, found_inf_ptr, tl.max(bad))
    else:
        tl.atomic_max(stats_ptr + SKIP, 1.0)


@triton.jit
def factored_moments_kernel(
    row_state_ptr,
    col_state_ptr,
    ws_ptr,
    rows,
    cols,
    n_row_blocks,
    beta2_ptr,
    clip_coef_ptr,
    eps0,
    BLOCK: tl.constexpr,
):
    """R and C from the pass-A sums, the clip coefficient and eps0 applied to their means
    (programs [0, n_row_blocks) do R); R_SUM += sum(R)."""
    stats_ptr = ws_ptr + rows + cols
    if tl.load(stats_ptr + SKIP) == 0:
        b, omb = _beta(beta2_ptr)
        coef = _factor(clip_coef_ptr)
        pid = tl.program_id(0).to(tl.int64)
        if pid < n_row_blocks:
            idx = pid * BLOCK + tl.arange(0, BLOCK)
            mask = idx < rows
            acc = tl.load(ws_ptr + idx, mask=mask, other=0.0)
            mean = _mean_u(acc, cols, coef, eps0)
            new = tl.load(row_state_ptr + idx, mask=mask, other=0.0) * b + mean * omb
            tl.store(row_state_ptr + idx, new, mask=mask)
            tl.atomic_add(stats_ptr + R_SUM, tl.sum(tl.where(mask, new, 0.0)), sem="relaxed")
        else:
            idx = (pid - n_row_blocks) * BLOCK + tl.arange(0, BLOCK)
            mask = idx < cols
            acc = tl.load(ws_ptr + rows + idx, mask=mask, other=0.0)
            mean = _mean_u(acc, rows, coef, eps0)
            new = tl.load(col_state_ptr + idx, mask=mask, other=0.0) * b + mean * omb
            tl.store(col_state_ptr + idx, new, mask=mask)


@triton.jit
def _update_tiles(
    row_state_ptr,
    col_state_ptr,
    stats_ptr,
    rows,
    cols,
    offset,
    n,
    rows_per_prog,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """(tiles, iterations) of this program's part of r_i * c_j * g_ij (passes B and C) over
    the flat elements [offset, offset + n) of the [rows, cols] matrix, which grad (and param)
    hold from their element 0: tiles holds the slice's rows (`_slice_rows`), the column
    block's c_j = rsqrt(C_j) and mean(R)."""
    tile_rows, n_iter = _slice_rows(offset, n, cols, rows_per_prog, BLOCK_M, BLOCK_N)
    cols_idx, col_mask = tile_rows[3], tile_rows[4]
    c = tl.math.rsqrt(tl.load(col_state_ptr + cols_idx, mask=col_mask, other=1.0))
    mean = tl.load(stats_ptr + R_SUM) / rows
    return (row_state_ptr, mean, c, tile_rows), n_iter


@triton.jit
def _factored_update(
    source,
    tiles,
    it,
    GRAD_KIND: tl.constexpr,
    HAS_CLIP_VALUE: tl.constexpr,
    HAS_CLIP_COEF: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """(update, flat indices in the matrix, offsets in grad, mask) of tile `it` of `tiles`
    ([BLOCK_M, BLOCK_N]): r_i * c_j * g_ij, with r_i = rsqrt(R_i / mean(R))."""
    row_state_ptr, mean, c, tile_rows = tiles
    rows_idx, row_mask, index, offs, mask = _slice_tile(tile_rows, it, BLOCK_M)
    r = tl.math.rsqrt(tl.load(row_state_ptr + rows_idx, mask=row_mask, other=1.0) / mean)
    g, _ = _grad(source, offs, mask, GRAD_KIND, HAS_CLIP_VALUE, HAS_CLIP_COEF)
    return (r[:, None] * c[None, :]) * g, index, offs, mask


@triton.jit(do_not_specialize=["offset", "n"])
def factored_norm_kernel(
    grad_ptr,
    row_state_ptr,
    col_state_ptr,
    ws_ptr,
    rows,
    cols,
    offset,
    n,
    rows_per_prog,
    inv_scale_ptr,
    clip_value,
    clip_coef_ptr,
    GRAD_KIND: tl.constexpr,
    HAS_CLIP_VALUE: tl.constexpr,
    HAS_CLIP_COEF: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Pass B: U_SUMSQ += sum((rsqrt(R_i / mean(R)) * rsqrt(C_j) * g_ij)^2) over the slice
    `grad` of the matrix's flat elements [offset, offset + n)."""
    stats_ptr = ws_ptr + rows + cols
    if tl.load(stats_ptr + SKIP) == 0:
        source = _grad_source(grad_ptr, inv_scale_ptr, clip_value, clip_coef_ptr)
        tiles, n_iter = _update_tiles(
            row_state_ptr,
            col_state_ptr,
            stats_ptr,
            rows,
            cols,
            offset,
            n,
            rows_per_prog,
            BLOCK_M,
            BLOCK_N,
        )
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for it in range(0, n_iter):
            update, _, _, mask = _factored_update(
                source, tiles, it, GRAD_KIND, HAS_CLIP_VALUE, HAS_CLIP_COEF, BLOCK_M
            )
            acc += tl.where(mask, update * update, 0.0)
        tl.atomic_add(stats_ptr + U_SUMSQ, tl.sum(acc), sem="relaxed")


@triton.jit(do_not_specialize=["offset", "n", "seed_lo", "seed_hi"])
def factored_apply_kernel(
    param_ptr,
    grad_ptr,
    row_state_ptr,
    col_state_ptr,
    ws_ptr,
    rows,
    cols,
    offset,
    n,
    rows_per_prog,
    numel_f,
    lr_ptr,
    eps1,
    clip_threshold,
    weight_decay,
    inv_scale_ptr,
    clip_value,
    clip_coef_ptr,
    seed_lo,
    seed_hi,
    seed_step_ptr,
    GRAD_KIND: tl.constexpr,
    PARAM_KIND: tl.constexpr,
    HAS_CLIP_VALUE: tl.constexpr,
    HAS_CLIP_COEF: tl.constexpr,
    STOCHASTIC_ROUNDING: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Pass C: p = p * decay - scale * r_i * c_j * g_ij over the slice `param` of the
    matrix's flat elements [offset, offset + n) (nothing written when skipped), rounded as
    the LOMO update rounds (key `seed_lo ^ mix32(seed_hi ^ step)`, the step read here from
    `seed_step_ptr`, the bits of each element's flat index in the matrix)."""
    stats_ptr = ws_ptr + rows + cols
    if tl.load(stats_ptr + SKIP) == 0:
        source = _grad_source(grad_ptr, inv_scale_ptr, clip_value, clip_coef_ptr)
        step = (lr_ptr, eps1, clip_threshold, weight_decay)
        rounding = (seed_lo, seed_hi, seed_step_ptr)
        write_back = _write_back(param_ptr, stats_ptr, numel_f, step, rounding, STOCHASTIC_ROUNDING)
        tiles, n_iter = _update_tiles(
            row_state_ptr,
            col_state_ptr,
            stats_ptr,
            rows,
            cols,
            offset,
            n,
            rows_per_prog,
            BLOCK_M,
            BLOCK_N,
        )
        for it in range(0, n_iter):
            update, index, offs, mask = _factored_update(
                source, tiles, it, GRAD_KIND, HAS_CLIP_VALUE, HAS_CLIP_COEF, BLOCK_M
            )
            _apply(write_back, update, offs, index, mask, PARAM_KIND, STOCHASTIC_ROUNDING)


# ----------------------------------------------------------------------------- 1-D


@triton.jit
def _vector_update(
    source,
    v_ptr,
    offs,
    mask,
    beta2_ptr,
    eps0,
    GRAD_KIND: tl.constexpr,
    HAS_CLIP_VALUE: tl.constexpr,
    HAS_CLIP_COEF: tl.constexpr,
):
    """(update, v_new, finite) of one block; masked lanes give update 0."""
    b, omb = _beta(beta2_ptr)
    g, finite = _grad(source, offs, mask, GRAD_KIND, HAS_CLIP_VALUE, HAS_CLIP_COEF)
    v_new = tl.load(v_ptr + offs, mask=mask, other=1.0) * b + (g * g + eps0) * omb
    return tl.math.rsqrt(v_new) * g, v_new, finite


@triton.jit
def vector_stats_kernel(
    grad_ptr,
    param_ptr,
    v_ptr,
    ws_ptr,
    found_inf_ptr,
    skip_if_ptr,
    n,
    beta2_ptr,
    eps0,
    inv_scale_ptr,
    clip_value,
    clip_coef_ptr,
    GRAD_KIND: tl.constexpr,
    PARAM_KIND: tl.constexpr,
    HAS_CLIP_VALUE: tl.constexpr,
    HAS_CLIP_COEF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Pass A1: U_SUMSQ += sum(update^2), P_SUMSQ += sum(p^2); v is read, not written."""
    if _runs(ws_ptr, skip_if_ptr):
        source = _grad_source(grad_ptr, inv_scale_ptr, clip_value, clip_coef_ptr)
        offs, mask = _vector_block(n, BLOCK)
        update, _, finite = _vector_update(
            source, v_ptr, offs, mask, beta2_ptr, eps0, GRAD_KIND, HAS_CLIP_VALUE, HAS_CLIP_COEF
        )
        tl.atomic_add(ws_ptr + U_SUMSQ, tl.sum(tl.where(mask, update * update, 0.0)), sem="relaxed")
        p = _load_fp32(param_ptr, offs, mask, PARAM_KIND)
        tl.atomic_add(ws_ptr + P_SUMSQ, tl.sum(p * p), sem="relaxed")
        _raise_flags(ws_ptr, found_inf_ptr, tl.max((~finite).to(tl.int32)))
    else:
        tl.atomic_max(ws_ptr + SKIP, 1.0)


@triton.jit(do_not_specialize=["offset", "seed_lo", "seed_hi"])
def vector_apply_kernel(
    param_ptr,
    grad_ptr,
    v_ptr,
    ws_ptr,
    n,
    offset,
    numel_f,
    beta2_ptr,
    eps0,
    lr_ptr,
    eps1,
    clip_threshold,
    weight_decay,
    inv_scale_ptr,
    clip_value,
    clip_coef_ptr,
    seed_lo,
    seed_hi,
    seed_step_ptr,
    GRAD_KIND: tl.constexpr,
    PARAM_KIND: tl.constexpr,
    HAS_CLIP_VALUE: tl.constexpr,
    HAS_CLIP_COEF: tl.constexpr,
    STOCHASTIC_ROUNDING: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Pass C1: v = v_new, p = p * decay - scale * g * rsqrt(v_new) (nothing when skipped),
    rounded as in pass C with the bits of index offset + j (param a slice at `offset` of a
    vector of numel_f elements)."""
    if tl.load(ws_ptr + SKIP) == 0:
        source = _grad_source(grad_ptr, inv_scale_ptr, clip_value, clip_coef_ptr)
        step = (lr_ptr, eps1, clip_threshold, weight_decay)
        rounding = (seed_lo, seed_hi, seed_step_ptr)
        write_back = _write_back(param_ptr, ws_ptr, numel_f, step, rounding, STOCHASTIC_ROUNDING)
        offs, mask = _vector_block(n, BLOCK)
        update, v_new, _ = _vector_update(
            source, v_ptr, offs, mask, beta2_ptr, eps0, GRAD_KIND, HAS_CLIP_VALUE, HAS_CLIP_COEF
        )
        tl.store(v_ptr + offs, v_new, mask=mask)
        index = offset.to(tl.int64) + offs
        _apply(write_back, update, offs, index, mask, PARAM_KIND, STOCHASTIC_ROUNDING)
