"""AdaLomo's passes on a shard's slice (ZeRO-3, FSDP2): the factored pass A, norm and
write-back at a flat offset of the moments' matrix, the 1-D write-back at an offset of a
vector, on every backend.

The write-back is elementwise given the workspace's sums, so slices cut anywhere (mid-row,
inside one row, whole rows) step bit for bit as the whole tensor does, stochastic rounding
included (each element draws the bits of its index in the whole tensor). A slice's pass A
and norm add its share of the whole's sums, against float64 sums over its own elements. On the
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

from bench.adalomo_slices import VIEWS  # noqa: E402
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
from lomo_kernels.ops.adalomo.workspace import (  # noqa: E402
    G_SUMSQ,
    NUM_SLOTS,
    P_SUMSQ,
    R_SUM,
    SKIP,
    U_SUMSQ,
)
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


def _slice_mask(a: int, b: int, device) -> torch.Tensor:
    """1.0 at the slice [a, b) of the flat [ROWS, COLS] matrix, else 0 (float64)."""
    mask = torch.zeros(ROWS * COLS, dtype=torch.float64, device=device)
    mask[a:b] = 1.0
    return mask.view(ROWS, COLS)


@pytest.mark.gpu_smoke  # the GPU check runs these on the device
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_factored_stats_of_a_slice_are_its_share(backend, test_device, dtype):
    """Pass A of a slice at its offset adds, in the whole matrix's workspace, the row and
    column sums of g^2 over its own elements only (rows it does not touch stay 0), and its
    share of sum(p^2) and sum(h^2): each entry within the bound of summing its m fp32
    squares ((m + 1) units of fp32 rounding, relative, for positive terms) of the float64
    sum of those squares over exactly the slice's elements. Slices cut mid-row, inside one
    row and across whole rows."""
    param = make_param((ROWS, COLS), dtype, seed=11).to(test_device)
    grad = (make_param((ROWS, COLS), dtype, seed=12) * 0.5).to(test_device)
    g2 = grad.float().square().double()  # the fp32 square of each element, exactly
    p2 = param.float().square().double()
    unit = 2.0**-24
    for a, b in _spans(CUTS):
        mine = adalomo_workspace(param)
        adalomo_factored_stats_(grad.view(-1)[a:b].clone(), param.view(-1)[a:b].clone(), mine,
                                offset=a, full_shape=param.shape, backend=backend)  # fmt: skip
        mask = _slice_mask(a, b, test_device)
        for got, terms, count in (
            (mine[:ROWS], (g2 * mask).sum(1), mask.sum(1)),
            (mine[ROWS : ROWS + COLS], (g2 * mask).sum(0), mask.sum(0)),
        ):
            bound = (count + 1) * unit * terms
            assert ((got.double() - terms).abs() <= bound).all(), (a, b)
            assert torch.equal(got[count == 0], torch.zeros_like(got[count == 0]))
        slots = mine[ROWS + COLS :].double()
        for slot, squares in ((P_SUMSQ, p2), (G_SUMSQ, g2)):
            expected = (squares * mask).sum().item()
            assert abs(slots[slot].item() - expected) <= (b - a + 1) * unit * expected, (a, b)
        assert slots[SKIP].item() == 0.0


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_factored_stats_of_a_slice_flag_its_own_non_finite_gradient(backend, dtype):
    """A non-finite gradient element marks the slice that holds it, and only that one,
    skipped and raises found_inf."""
    param = make_param((ROWS, COLS), dtype, seed=11)
    grad = make_param((ROWS, COLS), dtype, seed=12)
    bad_at = 3 * COLS + 500  # inside row 3's inner slice
    grad.view(-1)[bad_at] = float("inf")
    for a, b in _spans(CUTS):
        mine, found = adalomo_workspace(param), torch.zeros(1)
        adalomo_factored_stats_(grad.view(-1)[a:b], param.view(-1)[a:b], mine, found_inf=found,
                                offset=a, full_shape=param.shape, backend=backend)  # fmt: skip
        holds_it = a <= bad_at < b
        assert mine[ROWS + COLS + SKIP].item() == float(holds_it), (a, b)
        assert found.item() == float(holds_it), (a, b)


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
        # pass A: past the matrix's end, and an offset without the parameter's shape
        lambda: adalomo_factored_stats_(
            grad.view(-1)[5:], flat[5:], workspace, offset=6, full_shape=param.shape
        ),  # fmt: skip
        lambda: adalomo_factored_stats_(grad.view(-1)[5:], flat[5:], workspace, offset=5),
    ]
    for call in cases:
        with pytest.raises(ValueError, match="offset"):
            call()
    vector, v = torch.zeros(8, dtype=torch.bfloat16), torch.ones(8)
    with pytest.raises(ValueError, match="full_numel=10"):
        adalomo_vector_apply_(vector, vector, v, torch.zeros(NUM_SLOTS), beta2=0.5, **STEP,
                              offset=3, full_numel=10)  # fmt: skip
    with pytest.raises(ValueError, match="workspace"):  # not the workspace of full_shape
        adalomo_factored_stats_(grad.view(-1)[5:], flat[5:], workspace[1:], offset=5,
                                full_shape=param.shape)  # fmt: skip
    assert torch.equal(param, before) and not vector.any() and torch.equal(v, torch.ones(8))


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _sliced_step_ops(rows: int, shape_cols: int, vector: bool, slices: int = 1) -> Counter[str]:
    """Torch ops one rank's sliced AdaLomo step runs (the C++ backend: a fused pass is one
    op) on a bucket of `slices` parameters, each slice cut mid-row at both ends (a 1-D
    parameter: at both ends too)."""
    shape = (rows * shape_cols,) if vector else (rows, shape_cols)
    a, b = shape_cols // 3, rows * shape_cols - shape_cols // 2
    arguments = adalomo_step_arguments(
        torch.device("cpu"), not vector, lr=1e-3, beta2=0.5, eps=(1e-30, 1e-3),
        clip_threshold=1.0, weight_decay=0.0, inv_scale=None, clip_value=None, clip_coef=None,
        found_inf=None, skip_if=None, stochastic_rounding=True, seed=1, seed_step=None,
    )  # fmt: skip
    steps, params = [], []
    for i in range(slices):
        param = make_param(shape, torch.bfloat16, seed=3 + i)
        grad = make_param(shape, torch.bfloat16, seed=40 + i)
        shard = Shard(param=param, local=param.view(-1)[a:b], offset=a, full_shape=param.shape,
                      group=None)  # fmt: skip
        steps.append(SliceStep(shard=shard, grad=grad.view(-1)[a:b],
                               state=init_slice_state(shard), arguments=arguments,
                               backend="cpp"))  # fmt: skip
        params.append(param)
    flags = torch.zeros(1), torch.zeros(1)
    with _CountOps() as counter:
        adalomo_slices_(steps, *flags, lambda t: None)
    for i, param in enumerate(params):
        before = make_param(shape, torch.bfloat16, seed=3 + i)
        assert not torch.equal(param.view(-1)[a:b], before.view(-1)[a:b])
    return counter.counts


def _fused(counts: Counter[str]) -> dict[str, int]:
    return {name.split(".")[1]: n for name, n in counts.items() if name.startswith("lomo_")}


@pytest.mark.parametrize("vector", [False, True], ids=["factored", "1-D"])
def test_a_sliced_step_runs_as_many_ops_whatever_the_slice_size(vector):
    """A rank's slice is stepped by fused passes over the slice, not by torch ops per block
    or piece of it: a slice 8 times longer (past several 64K-element blocks) runs the same
    ops, each pass one op on the whole slice."""
    small = _sliced_step_ops(16, 1031, vector)
    assert _sliced_step_ops(128, 1031, vector) == small
    if vector:
        assert _fused(small) == {"adalomo_vector_stats_": 1, "adalomo_vector_apply_": 1}
    else:
        passes = ("stats", "moments", "norm", "apply")
        assert _fused(small) == {f"adalomo_factored_{name}_": 1 for name in passes}


@pytest.mark.parametrize("vector", [False, True], ids=["factored", "1-D"])
def test_a_bucket_runs_each_slice_s_passes_and_the_rest_once(vector):
    """A bucket of four slices runs each slice's fused passes and, besides views, exactly
    the ops of a bucket of one: the workspaces, skip decisions and all-reduced sums are
    handled for the whole bucket at once (on a GPU each such op is a launch)."""
    one, four = _sliced_step_ops(16, 1031, vector), _sliced_step_ops(16, 1031, vector, slices=4)
    assert _fused(four) == {name: 4 * n for name, n in _fused(one).items()}
    rest = {name for name in one.keys() | four.keys() if not name.startswith("lomo_")}
    launched = {name: (one[name], four[name]) for name in rest - VIEWS}
    assert all(a == b for a, b in launched.values()), launched
