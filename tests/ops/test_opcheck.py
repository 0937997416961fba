"""`torch.library.opcheck` on every fused op, with every backend that serves CPU tensors here.

opcheck runs each op eagerly, under FakeTensor (the fake implementation), through
AOTAutograd's functionalization and with schema checks: the mutation annotations of the
schema must match what each backend writes, and the fake must agree with the real kernel.
Triton runs through its interpreter (tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from lomo_kernels.ops import backends  # (importing the ops registers them)
from lomo_kernels.ops.adalomo.workspace import NUM_SLOTS, P_SUMSQ, R_SUM, U_SUMSQ

OPS = torch.ops.lomo_kernels
BACKENDS = ["torch", "cpp", "triton"]


def _scalar(value: float) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.float32)


def _grad_args() -> tuple:
    """(inv_scale, clip_value, clip_coef) with every option active."""
    return (_scalar(0.5), 2.0, _scalar(0.9))


def _lomo_update_args(seed_step: torch.Tensor | None) -> tuple:
    """Stochastic rounding, every option active, a slice at flat offset 300; `seed_step`:
    the per-step seed tensor."""
    param = torch.randn(4103, dtype=torch.bfloat16)
    grad = torch.randn(4103, dtype=torch.float16)
    return (
        param,
        grad,
        _scalar(0.05),
        *_grad_args(),
        0.01,
        torch.zeros(1),
        None,
        True,
        7,
        seed_step,
        300,
    )


def _grad_accumulate_args(first: bool) -> tuple:
    """Stochastic rounding of a bf16 buffer from an fp16 gradient, sumsq and found_inf."""
    buffer = torch.randn(4103, dtype=torch.bfloat16)
    grad = torch.randn(4103, dtype=torch.float16)
    seed_step = torch.tensor([99], dtype=torch.int64)
    return (
        buffer,
        grad,
        first,
        _scalar(0.5),
        torch.zeros(1),
        torch.zeros(1),
        True,
        7,
        seed_step,
        300,
    )


def _int8_buffer(offset: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An 8-bit buffer of n elements at `offset` (codes, scales): random codes, one scale."""
    from lomo_kernels.core.int8_blocks import blocks_of

    codes = torch.randint(-127, 128, (n,), dtype=torch.int8)
    scales = torch.full((blocks_of(offset, n),), 2.0**-7)
    return codes, scales


def _int8_cases() -> list[tuple]:
    """The 8-bit buffer's ops on a slice at offset 300 (partial first and last blocks)."""
    offset, n = 300, 4103
    grad = torch.randn(n, dtype=torch.float16)
    seed_step = torch.tensor([99], dtype=torch.int64)
    accumulate = (*_int8_buffer(offset, n), grad, offset, False, _scalar(0.5), torch.zeros(1),
                  torch.zeros(1), True, 7, seed_step)  # fmt: skip
    param = torch.randn(n, dtype=torch.bfloat16)
    update = (param, *_int8_buffer(offset, n), offset, _scalar(0.05), *_grad_args(), 0.01,
              torch.zeros(1), None, True, 7, seed_step)  # fmt: skip
    dequantize = (torch.empty(n, dtype=torch.bfloat16), *_int8_buffer(offset, n), offset)
    return [
        (OPS.grad_accumulate_int8_, accumulate),
        (OPS.lomo_update_int8_, update),
        (OPS.int8_dequantize_, dequantize),
    ]


def _lomo_cases() -> list[tuple]:
    sumsq = (torch.randn(100, dtype=torch.bfloat16), _scalar(0.5), torch.zeros(1), torch.zeros(1))
    return [
        (OPS.lomo_update_, _lomo_update_args(None)),
        (OPS.lomo_update_, _lomo_update_args(torch.tensor([123456789], dtype=torch.int64))),
        (OPS.grad_sumsq_, sumsq),
        (OPS.grad_accumulate_, _grad_accumulate_args(first=False)),
        (OPS.grad_accumulate_, _grad_accumulate_args(first=True)),
        *_int8_cases(),
    ]


def _adalomo_cases() -> list[tuple]:
    rows, cols, n = 6, 10, 33
    g2, p2 = torch.randn(rows, cols, dtype=torch.bfloat16), torch.randn(rows, cols)
    g1, p1 = torch.randn(n, dtype=torch.float16), torch.randn(n, dtype=torch.bfloat16)
    row, col, v = torch.rand(rows) + 0.5, torch.rand(cols) + 0.5, torch.rand(n) + 0.5
    ws2, ws1 = torch.zeros(rows + cols + NUM_SLOTS), torch.zeros(NUM_SLOTS)
    ws2[rows + cols + R_SUM] = row.sum()  # as the moments pass leaves it
    ws1[P_SUMSQ], ws1[U_SUMSQ] = float(n), float(n)  # rms 1
    beta2, lr = _scalar(0.5), _scalar(0.1)
    step = torch.tensor([42], dtype=torch.int64)  # stochastic rounding of the bf16 p1
    grad_args = _grad_args()
    inv_scale, clip_value, clip_coef = grad_args
    return [
        (
            OPS.adalomo_factored_stats_,
            (g2, p2, ws2, torch.zeros(1), None, cols, inv_scale, clip_value, 0),
        ),
        (OPS.adalomo_factored_moments_, (row, col, ws2, beta2, clip_coef, 1e-30)),
        (OPS.adalomo_factored_norm_, (g2, row, col, ws2, *grad_args, 0)),
        (
            OPS.adalomo_factored_apply_,
            (p2, g2, row, col, ws2, lr, 1e-3, 1.0, 0.1, *grad_args, False, 0, None, 0),
        ),
        # A shard's slice: flat elements [7, 41) of the [rows, cols] matrix, cut mid-row.
        (
            OPS.adalomo_factored_stats_,
            (
                g2.reshape(-1)[7:41].clone(),
                p2.reshape(-1)[7:41].clone(),
                *(ws2, torch.zeros(1), None, cols, inv_scale, clip_value, 7),
            ),
        ),
        (OPS.adalomo_factored_norm_, (g2.reshape(-1)[7:41].clone(), row, col, ws2, *grad_args, 7)),
        (
            OPS.adalomo_factored_apply_,
            (
                p2.reshape(-1)[7:41].to(torch.bfloat16),
                g2.reshape(-1)[7:41].clone(),
                *(row, col, ws2, lr, 1e-3, 1.0, 0.1, *grad_args, True, 5, step, 7),
            ),
        ),
        (
            OPS.adalomo_vector_stats_,
            (g1, p1, v, ws1, torch.zeros(1), torch.zeros(1), beta2, 1e-30, *grad_args),
        ),
        (
            OPS.adalomo_vector_apply_,
            (p1, g1, v, ws1, beta2, 1e-30, lr, 1e-3, 1.0, 0.0, *grad_args, True, 5, step, 0, n),
        ),
        # A shard's slice: elements [9, 33) of a vector of 40.
        (
            OPS.adalomo_vector_apply_,
            (
                p1[9:].clone(),
                g1[9:].clone(),
                v[9:].clone(),
                ws1,
                beta2,
                1e-30,
                lr,
                1e-3,
                1.0,
                0.0,
                *grad_args,
                True,
                5,
                step,
                9,
                40,
            ),  # fmt: skip
        ),
    ]


# Every case of both lists, each on every backend (counted from the lists, so a case added
# there is checked here).
CASES = [
    pytest.param(family, index, backend, id=f"{family}{index}-{backend}")
    for backend in BACKENDS
    for family, count in (("lomo", len(_lomo_cases())), ("adalomo", len(_adalomo_cases())))
    for index in range(count)
]


@pytest.mark.parametrize("family,index,backend", CASES)
def test_opcheck(family: str, index: int, backend: str) -> None:
    cases = _lomo_cases() if family == "lomo" else _adalomo_cases()
    op, args = cases[index]
    with backends.dispatching_to(torch.device("cpu"), backend):
        torch.library.opcheck(op.default, args)


def test_opcheck_compiled_autograd_embedding_backward() -> None:
    """The op compiled autograd uses in place of Inductor's fp32 embedding backward."""
    grad = torch.randn(2, 5, 8, dtype=torch.bfloat16)
    indices = torch.randint(0, 11, (2, 5))
    for padding_idx in (-1, 3):
        args = (grad, indices, 11, padding_idx)
        torch.library.opcheck(OPS.embedding_dense_backward_eager.default, args)


def test_cross_entropy_ops() -> None:
    """The fused linear + cross-entropy ops: fp32 and bf16, an ignored token, a vocabulary
    that is no multiple of any block."""
    from lomo_kernels.ops import cross_entropy as lce

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        hidden = torch.randn(9, 16, generator=gen).to(dtype).requires_grad_()
        weight = torch.randn(41, 16, generator=gen).to(dtype).requires_grad_()
        labels = torch.randint(0, 41, (9,), generator=gen)
        labels[2] = -100
        torch.library.opcheck(lce._forward_op, (hidden, weight, labels, -100, 0.7))
        _, lse = lce._forward_op(hidden.detach(), weight.detach(), labels, -100, 0.7)
        grad = torch.rand(9, generator=gen)
        args = (grad, hidden.detach(), weight.detach(), labels, lse, -100, 0.7)
        torch.library.opcheck(lce._backward_op, args)


def test_every_op_is_checked() -> None:
    """The cases above cover every op of the namespace."""
    names = {case[0].default.name() for case in _lomo_cases() + _adalomo_cases()}
    names.add("lomo_kernels::embedding_dense_backward_eager")
    names |= {
        "lomo_kernels::linear_cross_entropy_forward",
        "lomo_kernels::linear_cross_entropy_backward",
    }
    registered = {
        f"lomo_kernels::{name}" for name in dir(OPS) if not name.startswith("_") and name != "name"
    }
    assert names == registered


def test_kernels_are_registered_per_device() -> None:
    """Each fused op has its own CPU and CUDA kernels, and a fake, besides the reference body."""
    for op, _ in _lomo_cases() + _adalomo_cases():
        qualname = op.default.name()
        for key in ("CPU", "CUDA", "Meta"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, key), (qualname, key)
