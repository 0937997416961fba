"""AdaLomo's write-back passes (factored_apply_, vector_apply_) on a backend module, prepared
by the reference's earlier passes, and compared bit for bit with the reference's: given the
same workspace and moments, their fp32 math agrees (correctly rounded sqrt and division, no
contraction)."""

from __future__ import annotations

import math

import torch

from lomo_kernels.ops.adalomo import adalomo_workspace, init_adalomo_state
from lomo_kernels.ops.adalomo import reference as adalomo_reference
from lomo_kernels.ops.adalomo.workspace import P_SUMSQ, R_SUM, stats_slots
from support.fp16_edges import EDGE_LR16, FP16_EDGE_PAIRS, fp16_edge_pairs_fp32
from support.lomo_bitwise import DTYPES, assert_same_bits

ADALOMO_SR_SHAPES = [(1,), (7,), (4097,), (278011,), (37, 1031), (1, 7), (2, 3, 7)]
ROUNDING_SEEDS = [(0, None), (2**62 + 3, torch.tensor([5], dtype=torch.int64))]
APPLY_OPTIONS = dict(eps1=1e-3, clip_threshold=0.8, weight_decay=0.1, clip_value=1.5)


def adalomo_scalars() -> dict[str, torch.Tensor]:
    return dict(
        lr=torch.tensor([0.05]),
        beta2=torch.tensor([0.5]),
        inv_scale=torch.tensor([0.5]),
        clip_coef=torch.tensor([0.37]),
    )


def prepared_write_back(shape, pdt: str, gdt: str):
    """(param, grad, state, workspace) ready for the write-back: the reference's passes A
    (A1), moments and B on a random parameter."""
    gen = torch.Generator().manual_seed(sum(shape))
    param = torch.randn(shape, generator=gen).to(DTYPES[pdt])
    grad = (torch.randn(shape, generator=gen) * 3).to(DTYPES[gdt])
    state, workspace = init_adalomo_state(param), adalomo_workspace(param)
    k, clip = adalomo_scalars(), APPLY_OPTIONS["clip_value"]
    if param.dim() >= 2:
        row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
        adalomo_reference.factored_stats_(
            grad, param, workspace, None, None, shape[-1], k["inv_scale"], clip, 0
        )
        adalomo_reference.factored_moments_(row, col, workspace, k["beta2"], k["clip_coef"], 1e-30)
        adalomo_reference.factored_norm_(
            grad, row, col, workspace, k["inv_scale"], clip, k["clip_coef"], 0
        )
    else:
        adalomo_reference.vector_stats_(
            grad, param, state["exp_avg_sq"], workspace, None, None, k["beta2"], 1e-30,
            k["inv_scale"], clip, k["clip_coef"],
        )  # fmt: skip
    return param, grad, state, workspace


def adalomo_write_back(
    module, param, grad, state, workspace, *, sr, seed=0, seed_step=None, **hyper
):
    """`module`'s write-back pass (C or C1) on copies; returns (param, state). `hyper`
    overrides the scalars (lr, beta2, eps0, ...)."""
    param, workspace = param.clone(), workspace.clone()
    state = {key: value.clone() for key, value in state.items()}
    a = adalomo_scalars() | dict(eps0=1e-30) | APPLY_OPTIONS | hyper
    tail = (a["eps1"], a["clip_threshold"], a["weight_decay"], a["inv_scale"], a["clip_value"])
    tail += (a["clip_coef"], sr, seed, seed_step)
    if param.dim() >= 2:
        row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
        module.factored_apply_(param, grad, row, col, workspace, a["lr"], *tail, 0)
    else:
        v = state["exp_avg_sq"]
        module.vector_apply_(
            param, grad, v, workspace, a["beta2"], a["eps0"], a["lr"], *tail, 0, param.numel()
        )
    return param, state


def assert_same_write_back(got, want, any_nan: bool = False) -> None:
    """Parameter and state bit for bit; with `any_nan`, a nan only has to be a nan (one that
    fp32 arithmetic makes, such as inf * 0, has no specified sign: torch and the kernels may
    differ there, and bf16 keeps that sign)."""
    if any_nan:
        nan = got[0].isnan()
        assert torch.equal(nan, want[0].isnan()), "nan positions differ"
        got, want = (got[0].masked_fill(nan, 0.0), got[1]), (want[0].masked_fill(nan, 0.0), want[1])
    assert_same_bits(got[0], want[0])
    for key, value in want[1].items():
        if any_nan:
            assert torch.equal(got[1][key].isnan(), value.isnan()), key
            assert torch.equal(got[1][key].nan_to_num(0.0), value.nan_to_num(0.0)), key
        else:
            assert torch.equal(got[1][key].view(torch.int32), value.view(torch.int32)), key


def edge_write_back_case(pdt: str, gdt: str, shape):
    """(param, grad, state, workspace, hyper) of a write-back whose results sit at fp16's
    boundaries (FP16_EDGE_VALUES, FP16_EDGE_PAIRS), at the start, in a middle row segment,
    across a row boundary (factored) or the 32768-element chunks of the threads (1-D), and
    at the end; an inf and a nan gradient in the middle group.

    Moments of 1 and a synthesized workspace make every factor exact: r = c = rsqrt(1) = 1
    (factored), v_new = v * 1 + (g^2 + 0) * 0 = 1 (1-D, beta2 = 1; nan for the inf grad),
    lr_t = lr * rms(p) from P_SUMSQ, scale = lr_t (U_SUMSQ 0), decay = 1: the new value is
    p - lr_t * g, lr_t being 1 (fp32 grads) or 2^-11 (bf16/fp16 grads) as there."""
    dtype, numel = DTYPES[pdt], math.prod(shape)
    gen = torch.Generator().manual_seed(numel)
    param = torch.randn(numel, generator=gen).to(dtype)
    if gdt == "fp32":
        grad = torch.randn(numel, generator=gen) * 1e-3
        pairs, lr_t = fp16_edge_pairs_fp32(), 1.0
    else:
        grad = torch.randn(numel, generator=gen).to(DTYPES[gdt])
        pairs, lr_t = FP16_EDGE_PAIRS, EDGE_LR16
    p_vals = torch.tensor([p for p, _ in pairs]).to(dtype)
    g_vals = torch.tensor([g for _, g in pairs]).to(grad.dtype)
    count = len(pairs)
    boundary = shape[-1] if len(shape) >= 2 else 32_768
    middle = numel // 2 - 3
    for start in (0, middle, boundary - count // 2, numel - count):
        param[start : start + count] = p_vals
        grad[start : start + count] = g_vals
    grad[middle + 3], grad[middle + 4] = float("inf"), float("nan")
    param, grad = param.view(shape), grad.view(shape)
    state = {key: torch.ones_like(value) for key, value in init_adalomo_state(param).items()}
    workspace = adalomo_workspace(param)
    stats = stats_slots(workspace)
    stats[P_SUMSQ] = numel * lr_t * lr_t  # rms(p) = lr_t, exactly
    stats[R_SUM] = state["exp_avg_sq_row"].numel() if len(shape) >= 2 else 0.0
    hyper = dict(
        lr=torch.tensor([1.0]), beta2=torch.tensor([1.0]), eps0=0.0, eps1=0.0,
        clip_threshold=1.0, weight_decay=0.0, inv_scale=None, clip_value=None, clip_coef=None,
    )  # fmt: skip
    return param, grad, state, workspace, hyper
