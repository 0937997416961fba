"""AdaLomo's float64 model (one step from the current values), the fused AdaLomo ops run
against it on a backend, and the error bounds they are held to."""

from __future__ import annotations

import math

import torch

from lomo_kernels.ops.adalomo import (
    adalomo_factored_moments_,
    adalomo_factored_stats_,
    adalomo_update_,
    adalomo_workspace,
    init_adalomo_state,
)
from lomo_kernels.ops.adalomo.workspace import (
    G_SUMSQ,
    NUM_SLOTS,
    P_SUMSQ,
    R_SUM,
    SKIP,
    U_SUMSQ,
    measured_view,
)
from support.float64 import ulp

LR = 0.05
EPS = (1e-30, 1e-3)
LOSS_SCALE = 2.0**10
CLIP_COEF = 0.37
OPTIONS = {
    "plain": {},
    # Loss-scaled gradients, clipping by value and by norm, decay, device-tensor scalars.
    "all": {
        "inv_scale": 1.0 / LOSS_SCALE,
        "clip_value": 1.5,
        "clip_coef": CLIP_COEF,
        "weight_decay": 0.1,
        "clip_threshold": 0.8,
        "tensors": True,
    },
}
# fp32 results: relative to the operands of the last subtraction, max(|p|, |lr_t*update|),
# which carry the fp32 reductions' errors (sums of p^2, u and update^2 over up to 262k
# elements, then rsqrt and products). Seen on AVX2 over every backend, shape and option set:
# 43 u (fp32), 96 u beyond the ulp (bf16), 47 u (fp16); held to 1e-5 (168 u).
# bf16/fp16: 1 ulp of the dtype at the result, plus the same fp32 allowance, which only
# matters where p and lr_t*update cancel (a result far smaller than its operands).
FP32_REL = 1e-5
# Moments: pass A's sums then the moments pass's 7 roundings (`check_moments`); seen 7.4 u.
# The any-order bound (n + 10) u of a sum of n terms exceeds 1e-5 from n = 158 on: the
# backends are held to what their tree and float64 partial sums achieve.
STATE_REL = 1e-5


def beta2_at(t: int) -> float:
    """The official schedule: beta2_t = 1 - t ** -0.8 (0 at the first step)."""
    return 1.0 - math.pow(t, -0.8)


def make_param(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype)


def make_grad(shape, dtype, step, inv_scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(1000 * seed + step)
    # Spans the clip value; columns of different scale make the factored moments non-trivial.
    scale = 1.0 + torch.arange(shape[-1], dtype=torch.float32) % 5
    return (torch.randn(shape, generator=gen) * scale / inv_scale).to(dtype)


# ----------------------------------------------------------------------------- float64 model


def adalomo_f64(
    param,
    grad,
    state,
    *,
    lr,
    beta2,
    eps=EPS,
    clip_threshold=1.0,
    weight_decay=0.0,
    inv_scale=1.0,
    clip_value=None,
    clip_coef=None,
):
    """One step from the current values: (new param, new state, |lr_t * update|), float64."""
    g = grad.double().reshape(-1) * inv_scale
    if clip_value is not None:
        g = g.clamp(-clip_value, clip_value)
    if clip_coef is not None:
        g = g * clip_coef
    u = g * g + eps[0]
    new_state = {}
    if param.dim() >= 2:
        cols = param.shape[-1]
        g2, u2 = g.view(-1, cols), u.view(-1, cols)
        row = beta2 * state["exp_avg_sq_row"].double() + (1 - beta2) * u2.mean(dim=1)
        col = beta2 * state["exp_avg_sq_col"].double() + (1 - beta2) * u2.mean(dim=0)
        update = g2 * torch.rsqrt(row / row.mean())[:, None] * torch.rsqrt(col)[None, :]
        update = update.reshape(-1)
        new_state = {"exp_avg_sq_row": row, "exp_avg_sq_col": col}
    else:
        v = beta2 * state["exp_avg_sq"].double() + (1 - beta2) * u
        update = g * torch.rsqrt(v)
        new_state = {"exp_avg_sq": v}
    n = g.numel()
    update = update / max(1.0, (update.norm() / math.sqrt(n)).item() / clip_threshold)
    p = param.double().reshape(-1)
    lr_t = lr * max(eps[1], (p.norm() / math.sqrt(n)).item())
    delta = lr_t * update
    return p * (1 - lr_t * weight_decay) - delta, new_state, delta.abs()


def check_param(out, ref, before, delta, dtype):
    scale = torch.maximum(before.double().reshape(-1).abs(), delta)
    bound = FP32_REL * scale
    if dtype != torch.float32:
        bound = bound + ulp(ref, dtype)
    err = (out.double().reshape(-1) - ref).abs()
    bad = err > bound
    if bad.any():
        i = int(bad.nonzero()[0])
        raise AssertionError(
            f"{int(bad.sum())} {dtype} elements out of bounds; first at {i}: out="
            f"{out.reshape(-1)[i].item()!r} ref={ref[i].item()!r} bound={bound[i].item():.3g}"
        )


def check_state(state, ref_state):
    assert set(state) == set(ref_state)
    for key, ref in ref_state.items():
        out = state[key].double()
        rel = ((out - ref).abs() / ref.abs()).max().item()
        assert rel <= STATE_REL, f"{key}: max rel error {rel:.3g}"


def call_kwargs(options):
    """(kwargs for adalomo_update_, kwargs for adalomo_f64) of an option set."""
    kwargs = {k: v for k, v in options.items() if k != "tensors"}
    model = dict(kwargs)
    if options.get("tensors") and "clip_coef" in kwargs:
        kwargs["clip_coef"] = torch.tensor([kwargs["clip_coef"]])
    return kwargs, model


def run_steps(backend, shape, dtype, options, steps):
    kwargs, model = call_kwargs(options)
    inv_scale = options.get("inv_scale", 1.0)
    param, state = make_param(shape, dtype), {}
    for t in range(1, steps + 1):
        grad = make_grad(shape, dtype, t, inv_scale)
        before = param.clone()
        prev_state = {k: v.clone() for k, v in (state or init_adalomo_state(param)).items()}
        ref, ref_state, delta = adalomo_f64(
            before, grad, prev_state, lr=LR, beta2=beta2_at(t), **model
        )
        lr, beta2 = LR, beta2_at(t)
        if options.get("tensors"):
            lr, beta2 = torch.tensor([lr]), torch.tensor([beta2])
        found_inf = torch.zeros(1)
        adalomo_update_(
            param, grad, state, lr=lr, beta2=beta2, found_inf=found_inf, backend=backend, **kwargs
        )
        assert found_inf.item() == 0.0
        check_param(param, ref, before, delta, dtype)
        check_state(state, ref_state)


# fp32 unit roundoff. Error bounds of the pass-A sums: each term is an fp32 square of an
# exactly scaled value (inv_scale is a power of 2), relative error <= U; a sum of n
# non-negative terms accumulated in fp32 in any order is within (n - 1) * U of the exact sum
# (to first order), and the workspace add rounds once more: (n + 2) * U in all, whatever the
# backend's order or its float64 partial sums.
U = 2.0**-24
FACTORED_SHAPES = [(1, 1), (3, 5), (17, 33), (2, 3, 7), (64, 4097), (1, 70000)]


def pass_a_f64(grad, param, inv_scale, clip_value):
    """(row sums, column sums of clamp(h)^2, sum h^2, sum p^2), h = grad * inv_scale; float64."""
    cols = grad.shape[-1]
    h = grad.double().reshape(-1, cols) * inv_scale
    g = h if clip_value is None else h.clamp(-clip_value, clip_value)
    p = param.double().reshape(-1, cols)
    return (g * g).sum(1), (g * g).sum(0), (h * h).sum(), (p * p).sum()


def assert_sums_close(out, ref, terms, what):
    bound = (terms + 2) * U * ref.abs()
    err = (out.double().cpu() - ref).abs()
    assert bool((err <= bound).all()), f"{what}: error {err.max().item():.3g}, bound {bound}"


def check_pass_a(backend, shape, dtype, options, device="cpu"):
    """adalomo_factored_stats_ on `device` against the float64 sums."""
    inv_scale, clip_value = options.get("inv_scale", 1.0), options.get("clip_value")
    param = make_param(shape, dtype).to(device)
    grad = make_grad(shape, dtype, 1, inv_scale).to(device)
    workspace, found_inf = adalomo_workspace(param), torch.zeros(1, device=device)
    adalomo_factored_stats_(
        grad,
        param,
        workspace,
        inv_scale=inv_scale,
        clip_value=clip_value,
        found_inf=found_inf,
        backend=backend,
    )
    row_ref, col_ref, h_ref, p_ref = pass_a_f64(grad.cpu(), param.cpu(), inv_scale, clip_value)
    rows, cols = row_ref.numel(), col_ref.numel()
    ws = workspace.cpu()
    stats = ws[rows + cols :]
    assert_sums_close(ws[:rows], row_ref, cols, "row sums")
    assert_sums_close(ws[rows : rows + cols], col_ref, rows, "column sums")
    assert_sums_close(stats[G_SUMSQ], h_ref, rows * cols, "G_SUMSQ")
    assert_sums_close(stats[P_SUMSQ], p_ref, rows * cols, "P_SUMSQ")
    assert stats[[U_SUMSQ, SKIP, R_SUM]].tolist() == [0.0, 0.0, 0.0]
    assert found_inf.item() == 0.0
    assert measured_view(workspace).tolist() == stats[[G_SUMSQ, SKIP]].tolist()
    if clip_value is not None and rows * cols > 1:
        # Clamping changes the sums by far more than the bound: a backend summing the
        # clamped values into G_SUMSQ, or the unclamped ones into the rows, fails.
        assert h_ref > 1.5 * row_ref.sum()


def moments_f64(state, sums, count, beta2, coef, eps0):
    """b * state + (1 - b) * (c^2 * sums / count + eps0), float64 (c = 1 without one)."""
    c = 1.0 if coef is None else coef
    scaled = torch.zeros_like(sums) if c == 0 else c * c * sums / count
    return beta2 * state.double() + (1 - beta2) * (scaled + eps0)


def check_moments(backend, rows, cols, coef, device="cpu"):
    """adalomo_factored_moments_ on `device` against the float64 model.

    Every operand is non-negative, so the fp32 operations (sum/count, two products by c,
    + eps0, two products by b and 1 - b, one add) carry at most 7 roundings: 8 U relative;
    R_SUM adds a sum of `rows` non-negative terms: (rows + 8) U.
    """
    gen = torch.Generator().manual_seed(rows * cols)
    row = torch.rand(rows, generator=gen) + 0.1
    col = torch.rand(cols, generator=gen) + 0.1
    workspace = torch.zeros(rows + cols + NUM_SLOTS)
    workspace[: rows + cols] = torch.rand(rows + cols, generator=gen) * 100
    if coef == 0.0:
        workspace[0] = float("inf")  # an overflowed sum times a zero coefficient: no nan
    beta2, eps0 = 0.75, 0.25  # a large eps0: applying it before the coefficient would show
    row_ref = moments_f64(row, workspace[:rows].double(), cols, beta2, coef, eps0)
    col_ref = moments_f64(col, workspace[rows : rows + cols].double(), rows, beta2, coef, eps0)
    row, col, workspace = row.to(device), col.to(device), workspace.to(device)
    adalomo_factored_moments_(
        row,
        col,
        workspace,
        beta2=torch.tensor([beta2], device=device),
        clip_coef=None if coef is None else torch.tensor([coef], device=device),
        eps0=eps0,
        backend=backend,
    )
    for out, ref in ((row, row_ref), (col, col_ref)):
        rel = ((out.cpu().double() - ref).abs() / ref).max().item()
        assert rel <= 8 * U, rel
    r_sum = workspace[rows + cols + R_SUM].item()
    assert abs(r_sum - row_ref.sum().item()) <= (rows + 8) * U * row_ref.sum().item()
