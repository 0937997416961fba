"""LOMO update cases that a backend module must store bit for bit as the reference backend
does: inputs with inf/nan and subnormal specials, the option sets, and the comparison.

The backend functions take their arguments positionally (`lomo_reference.lomo_update_` order),
the runtime scalars lr, inv_scale and clip_coef as 1-element fp32 tensors (None: 1).
"""

from __future__ import annotations

import torch

from lomo_kernels.ops.lomo import cpp_backend as cpp_backend
from lomo_kernels.ops.lomo import reference as reference

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
COMBOS = [(p, g) for p in DTYPES for g in DTYPES]
INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
INF, NAN = float("inf"), float("nan")
SR_DTYPES = ["bf16", "fp16"]  # the parameter dtypes stochastic rounding applies to


# Option sets: no-ops, and two sets of values with every option on. lr, inv_scale and
# clip_coef are the values of the runtime scalars (None: absent, as the public functions pass a
# factor of exactly 1); `run_update` hands them over as device tensors.
OPTION_SETS = {
    "plain": dict(lr=1e-2, inv_scale=None, clip_value=None, clip_coef=None, weight_decay=0.0),
    "full": dict(lr=2e-2, inv_scale=1 / 1024, clip_value=1.5, clip_coef=0.75, weight_decay=0.1),
    "tensors": dict(
        lr=1.5e-2, inv_scale=1 / 2048, clip_value=2.0, clip_coef=0.6, weight_decay=0.05
    ),
}


def option_set(kind: str) -> dict:
    """A copy of OPTION_SETS[kind] (callers extend it with `|`)."""
    return dict(OPTION_SETS[kind])


def scalar(value: float | None) -> torch.Tensor | None:
    """A runtime scalar as the backends take it: a 1-element fp32 tensor, or None."""
    return None if value is None else torch.tensor([value], dtype=torch.float32)


def grad_scale(kind: str) -> float:
    # Gradients arrive multiplied by the loss scale that inv_scale undoes.
    return {"plain": 1.0, "full": 1024.0, "tensors": 2048.0}[kind]


def make_param(n: int, dtype: torch.dtype, seed: int, specials: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    tiny = torch.finfo(dtype).tiny
    fixed = [0.0, -0.0, tiny / 4, -tiny / 2, tiny, 1.0, -2.0]
    if specials:
        fixed += [NAN, INF, -INF]
    for i, v in enumerate(fixed):  # odd positions; the grads' specials sit at even ones
        if 2 * i + 1 < n:
            p[2 * i + 1] = v
    return p.to(dtype)


def make_grad(n: int, dtype: torch.dtype, seed: int, scale: float, specials: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 1)
    g = torch.randn(n, generator=gen) * scale
    if specials and n >= 8:
        g[2], g[4], g[6] = INF, -INF, NAN
        g[n // 2] = INF  # a vector trip past the first (its offset keys stochastic rounding)
        g[n - 1] = NAN
    return g.to(dtype)


def int_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(INT_VIEW[t.dtype])


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-identical; for fp16/fp32 a nan only has to be a nan (torch's payloads vary)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    nan_got, nan_want = got.isnan(), want.isnan()
    assert torch.equal(nan_got, nan_want), "nan positions differ"
    if got.dtype == torch.bfloat16:  # the bf16 nan rule is specified in core/rounding.py
        mismatch = int_bits(got) != int_bits(want)
    else:
        mismatch = (int_bits(got) != int_bits(want)) & ~nan_got
    count = int(mismatch.sum())
    if count:
        i = int(mismatch.nonzero()[0])
        raise AssertionError(f"{count} elements differ, first at {i}: {got[i]} vs {want[i]}")


def run_update(
    module,
    param,
    grad,
    opts,
    *,
    found=None,
    skip=None,
    sr=False,
    seed=0,
    seed_step=None,
    offset=0,
) -> None:
    module.lomo_update_(
        param,
        grad,
        scalar(opts["lr"]),
        scalar(opts["inv_scale"]),
        opts["clip_value"],
        scalar(opts["clip_coef"]),
        opts["weight_decay"],
        found,
        skip,
        sr,
        seed,
        seed_step,
        offset,
    )


def cpp_and_reference(
    param, grad, opts, *, sr=False, seed=0, seed_step=None, with_skip=False, offset=0
):
    """Runs the C++ and reference updates on copies (`param` the slice at flat `offset` of its
    parameter); returns (params, found_inf flags)."""
    outs, flags = [], []
    for module in (cpp_backend, reference):
        p = param.clone()
        found = torch.zeros(1)
        skip = torch.zeros(1) if with_skip else None
        run_update(
            module, p, grad, opts, found=found, skip=skip, sr=sr, seed=seed, seed_step=seed_step,
            offset=offset,
        )  # fmt: skip
        outs.append(p)
        flags.append(found)
    return outs, flags


OPTION_SUBSETS = list(range(16))  # bits: unscale, clip, weight decay, clip_coef


def option_subset(bits: int) -> dict:
    """Each option on or neutral: the CPU kernel compiles neutral options out (16 loops)."""
    return dict(
        lr=2e-2,
        inv_scale=1 / 1024 if bits & 1 else None,
        clip_value=0.75 if bits & 2 else None,
        clip_coef=0.6 if bits & 8 else None,
        weight_decay=0.1 if bits & 4 else 0.0,
    )


def check_unaligned_views(pdt: str, gdt: str) -> None:
    """Views at odd storage offsets, updated in place: odd starts for the paired bf16 loop and
    the F16C tiles; the elements around the views must stay untouched."""
    n = 2**18 + 5
    pbuf = make_param(n + 3, DTYPES[pdt], seed=3, specials=True)
    grad = make_grad(n + 3, DTYPES[gdt], seed=3, scale=1024.0, specials=True)[3 : n + 3]
    buffers = []
    for module in (cpp_backend, reference):
        buf = pbuf.clone()
        run_update(module, buf[1 : n + 1], grad, option_set("full"), found=torch.zeros(1))
        buffers.append(buf)
    assert_same_bits(buffers[0], buffers[1])
