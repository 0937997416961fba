"""AdaLomo's update passes on a shard's slice (ZeRO-3, FSDP2): the factored norm and
write-back at a flat offset of the moments' matrix, the 1-D write-back at an offset of a
vector, on every backend.

The write-back is elementwise given the workspace's sums, so slices cut anywhere (mid-row,
inside one row, whole rows) step bit for bit as the whole tensor does, stochastic rounding
included (each element draws the bits of its index in the whole tensor). The norm of a slice
is its share of the whole's sum of update^2, against float64 sums of the fp32 updates. On the
test device (LOMO_TEST_DEVICE; the GPU check runs the ones marked gpu_smoke on a GPU).
"""

from __future__ import annotations

import os
from collections import Counter

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest  # noqa: E402
import torch  # noqa: E402
from support.adalomo import make_param  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from lomo_kernels.distributed.shard import Shard  # noqa: E402
from lomo_kernels.ops import (  # noqa: E402
    adalomo_factored_apply_,
    adalomo_factored_moments_,
    adalomo_factored_norm_,
    adalomo_factored_stats_,
    adalomo_vector_apply_,
    adalomo_vector_stats_,
    adalomo_workspace,
    init_adalomo_state,
)
from lomo_kernels.ops.adalomo import adalomo_step_arguments  # noqa: E402
from lomo_kernels.ops.adalomo.workspace import NUM_SLOTS, R_SUM, U_SUMSQ  # noqa: E402
from lomo_kernels.optim.adalomo_slices import (  # noqa: E402
    SliceStep,
    adalomo_slices_,
    init_slice_state,
)

ROWS, COLS = 37, 1031
# Cuts of the flat [ROWS, COLS] matrix: a part of row 0, rows 0-3 to mid-row 3, a slice
# inside row 3, the rest (whole rows and a partial first one).
CUTS = (0, 500, 3 * COLS + 17, 3 * COLS + 900, ROWS * COLS)
VECTOR = 4099
VECTOR_CUTS = (0, 1, 2047, VECTOR)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
STEP = {"lr": 1e-3, "eps1": 1e-3, "clip_threshold": 1.0, "weight_decay": 0.1}
# The write-back's dtypes and roundings: to nearest, and stochastically where the dtype has it.
WRITE_BACKS = [
    pytest.param(dtype, stochastic, id=f"{name}-{'stochastic' if stochastic else 'nearest'}")
    for name, dtype in DTYPES.items()
    for stochastic in (False, True)
    if not (stochastic and dtype == torch.float32)
]


def _rounding(stochastic: bool, device: str) -> dict:
    return {"stochastic_rounding": stochastic, "seed": 7,
            "seed_step": torch.tensor([3], device=device)}  # fmt: skip


def _spans(cuts):
    return list(zip(cuts[:-1], cuts[1:], strict=True))


def _factored_setup(dtype, backend, device):
    """A parameter, its gradient, moments after one moments pass and the workspace as pass C
    reads it (passes A, moments and B on the whole tensor)."""
    param = make_param((ROWS, COLS), dtype, seed=11).to(device)
    grad = (make_param((ROWS, COLS), dtype, seed=12) * 0.5).to(device)
    state, workspace = init_adalomo_state(param), adalomo_workspace(param)
    row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
    adalomo_factored_stats_(grad, param, workspace, backend=backend)
    adalomo_factored_moments_(row, col, workspace, beta2=0.5, backend=backend)
    adalomo_factored_norm_(grad, row, col, workspace, backend=backend)
    return param, grad, row, col, workspace


@pytest.mark.gpu_smoke  # the GPU check runs these on the device
@pytest.mark.parametrize(("dtype", "stochastic"), WRITE_BACKS)
def test_factored_write_back_of_slices_equals_the_whole(backend, test_device, dtype, stochastic):
    param, grad, row, col, workspace = _factored_setup(dtype, backend, test_device)
    rounding = _rounding(stochastic, test_device)
    whole = param.clone()
    adalomo_factored_apply_(whole, grad, row, col, workspace, **STEP, **rounding, backend=backend)
    assert not torch.equal(whole, param)  # it stepped
    pieces = []
    for a, b in _spans(CUTS):
        piece = param.view(-1)[a:b].clone()
        adalomo_factored_apply_(piece, grad.view(-1)[a:b].clone(), row, col, workspace.clone(),
                                **STEP, **rounding, offset=a, backend=backend)  # fmt: skip
        pieces.append(piece)
    assert torch.equal(torch.cat(pieces).view(torch.int8), whole.view(-1).view(torch.int8))


def _fp32_updates(grad, row, col, workspace) -> torch.Tensor:
    """The pass's update r_i * c_j * g_ij in fp32, as the reference forms it."""
    mean = workspace[ROWS + COLS + R_SUM] / ROWS
    r, c = torch.rsqrt(row / mean), torch.rsqrt(col)
    return (r[:, None] * c[None, :]) * grad.float()


@pytest.mark.gpu_smoke  # the GPU check runs these on the device
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_factored_norm_of_a_slice_is_its_share(backend, test_device, dtype):
    """Each slice adds the sum of its own elements' update^2: within the bound of summing
    n squares rounded to fp32 ((n + 1) units of fp32 rounding, relative, for positive
    terms) of the float64 sum of the fp32 updates over exactly those elements."""
    param, grad, row, col, workspace = _factored_setup(dtype, backend, test_device)
    squares = _fp32_updates(grad, row, col, workspace).double().square().view(-1)
    for a, b in _spans(CUTS):
        mine = workspace.clone()
        mine[ROWS + COLS + U_SUMSQ] = 0.0
        adalomo_factored_norm_(grad.view(-1)[a:b].clone(), row, col, mine, offset=a,
                               backend=backend)  # fmt: skip
        expected = squares[a:b].sum().item()
        got = mine[ROWS + COLS + U_SUMSQ].item()
        assert abs(got - expected) <= (b - a + 1) * 2.0**-24 * expected, (a, b)


@pytest.mark.gpu_smoke  # the GPU check runs these on the device
@pytest.mark.parametrize(("dtype", "stochastic"), WRITE_BACKS)
def test_vector_write_back_of_slices_equals_the_whole(backend, test_device, dtype, stochastic):
    param = make_param((VECTOR,), dtype, seed=13).to(test_device)
    grad = (make_param((VECTOR,), dtype, seed=14) * 0.5).to(test_device)
    v, workspace = init_adalomo_state(param)["exp_avg_sq"], adalomo_workspace(param)
    v += 0.25
    adalomo_vector_stats_(grad, param, v, workspace, beta2=0.5, backend=backend)
    rounding = _rounding(stochastic, test_device)
    whole, whole_v = param.clone(), v.clone()
    adalomo_vector_apply_(whole, grad, whole_v, workspace, beta2=0.5, **STEP, **rounding,
                          backend=backend)  # fmt: skip
    pieces, moments = [], []
    for a, b in _spans(VECTOR_CUTS):
        piece, piece_v = param[a:b].clone(), v[a:b].clone()
        adalomo_vector_apply_(piece, grad[a:b].clone(), piece_v, workspace.clone(), beta2=0.5,
                              **STEP, **rounding, offset=a, full_numel=VECTOR,
                              backend=backend)  # fmt: skip
        pieces.append(piece)
        moments.append(piece_v)
    assert torch.equal(torch.cat(pieces).view(torch.int8), whole.view(torch.int8))
    assert torch.equal(torch.cat(moments), whole_v)


def test_a_slice_that_does_not_fit_is_refused_before_any_change():
    param, grad, row, col, workspace = _factored_setup(torch.bfloat16, "torch", "cpu")
    flat, before = param.view(-1), param.clone()
    cases = [
        # past the matrix's end
        lambda: adalomo_factored_apply_(
            flat[5:], grad.view(-1)[5:], row, col, workspace, **STEP, offset=6
        ),  # fmt: skip
        lambda: adalomo_factored_norm_(grad.view(-1)[5:], row, col, workspace, offset=6),
        # an offset with a tensor of the moments' shape
        lambda: adalomo_factored_apply_(param, grad, row, col, workspace, **STEP, offset=1),
    ]
    for call in cases:
        with pytest.raises(ValueError, match="offset"):
            call()
    vector, v = torch.zeros(8, dtype=torch.bfloat16), torch.ones(8)
    with pytest.raises(ValueError, match="full_numel=10"):
        adalomo_vector_apply_(vector, vector, v, torch.zeros(NUM_SLOTS), beta2=0.5, **STEP,
                              offset=3, full_numel=10)  # fmt: skip
    assert torch.equal(param, before) and not vector.any() and torch.equal(v, torch.ones(8))


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _sliced_step_ops(rows: int, shape_cols: int, vector: bool) -> Counter[str]:
    """Torch ops one rank's sliced AdaLomo step runs (the C++ backend: a fused pass is one
    op), its slice cut mid-row at both ends (a 1-D parameter: at both ends too)."""
    shape = (rows * shape_cols,) if vector else (rows, shape_cols)
    param = make_param(shape, torch.bfloat16, seed=3)
    grad = make_param(shape, torch.bfloat16, seed=4)
    a, b = shape_cols // 3, param.numel() - shape_cols // 2
    shard = Shard(param=param, local=param.view(-1)[a:b], offset=a, full_shape=param.shape,
                  group=None)  # fmt: skip
    arguments = adalomo_step_arguments(
        torch.device("cpu"), True, lr=1e-3, beta2=0.5, eps=(1e-30, 1e-3), clip_threshold=1.0,
        weight_decay=0.0, inv_scale=None, clip_value=None, clip_coef=None, found_inf=None,
        skip_if=None, stochastic_rounding=True, seed=1, seed_step=None,
    )  # fmt: skip
    step = SliceStep(shard=shard, grad=grad.view(-1)[a:b], state=init_slice_state(shard),
                     arguments=arguments, backend="cpp")  # fmt: skip
    with _CountOps() as counter:
        adalomo_slices_([step], torch.zeros(1), torch.zeros(1), lambda t: None)
    assert not torch.equal(param.view(-1)[a:b], make_param(shape, torch.bfloat16, seed=3)
                           .view(-1)[a:b])  # fmt: skip
    return counter.counts


@pytest.mark.parametrize("vector", [False, True], ids=["factored", "1-D"])
def test_a_sliced_step_runs_as_many_ops_whatever_the_slice_size(vector):
    """A rank's slice is stepped by fused passes over the slice, not by torch ops per block
    of it: a slice 8 times longer (past several 64K-element blocks) runs the same ops."""
    small = _sliced_step_ops(16, 1031, vector)
    assert _sliced_step_ops(128, 1031, vector) == small
    fused = {name.split(".")[1]: n for name, n in small.items() if name.startswith("lomo_")}
    if vector:
        assert fused == {"adalomo_vector_stats_": 1, "adalomo_vector_apply_": 1}
    else:  # pass A on each piece (a partial first row, whole rows, a partial last row)
        assert fused == {"adalomo_factored_stats_": 3, "adalomo_factored_moments_": 1,
                         "adalomo_factored_norm_": 1, "adalomo_factored_apply_": 1}  # fmt: skip
