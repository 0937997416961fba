"""Fused AdaLomo passes on every backend against float64 math and the official lomo_optim code."""

from __future__ import annotations

import os

# Triton reads this when kernels are decorated: set before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from support.adalomo import (  # noqa: E402
    CLIP_COEF,
    EPS,
    FACTORED_SHAPES,
    LOSS_SCALE,
    LR,
    OPTIONS,
    adalomo_f64,
    beta2_at,
    call_kwargs,
    check_moments,
    check_param,
    check_pass_a,
    check_state,
    make_grad,
    make_param,
    run_steps,
)
from support.dependencies import require  # noqa: E402
from support.float64 import ulp  # noqa: E402
from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from lomo_kernels.ops import backends  # noqa: E402
from lomo_kernels.ops.adalomo import (  # noqa: E402
    adalomo_factored_stats_,
    adalomo_update_,
    adalomo_workspace,
    init_adalomo_state,
)
from lomo_kernels.ops.adalomo import reference as reference  # noqa: E402
from lomo_kernels.ops.adalomo.workspace import measured_view  # noqa: E402

CSRC = Path(__file__).resolve().parents[2] / "csrc"
SHAPES = [(1,), (7,), (4097,), (3, 5), (17, 33), (64, 4097), (2, 3, 7)]
# The official code handles 1-D and 2-D tensors only (it indexes shape[0] and shape[1]).
OFFICIAL_SHAPES = [s for s in SHAPES if len(s) <= 2]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _shape_id(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


def _update_at(t: int, param, grad, state, backend, **options) -> None:
    """`adalomo_update_` of step `t` (lr LR, beta2 of step t), `options` added."""
    adalomo_update_(param, grad, state, lr=LR, beta2=beta2_at(t), backend=backend, **options)


@pytest.mark.parametrize("options", OPTIONS.keys())
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_one_step_matches_float64(backend, shape, dtype, options):
    run_steps(backend, shape, dtype, OPTIONS[options], steps=1)


@pytest.mark.parametrize("magnitude", [0.0, 1e-5], ids=["zero", "tiny"])
@pytest.mark.parametrize("shape", [(7,), (3, 5)], ids=_shape_id)
def test_small_parameters_step_with_the_eps1_floor(backend, shape, magnitude):
    """rms(p) below eps[1]: lr_t = lr * eps[1], so a zero-initialised tensor still moves."""
    param = make_param(shape, torch.float32) * magnitude
    grad, before = make_grad(shape, torch.float32, 1), param.clone()
    state = init_adalomo_state(param)
    ref, _, delta = adalomo_f64(before, grad, state, lr=LR, beta2=beta2_at(1))
    adalomo_update_(param, grad, state, lr=LR, beta2=beta2_at(1), backend=backend)
    assert before.double().square().mean().sqrt() < EPS[1] / 10  # the floor sets lr_t
    check_param(param, ref, before, delta, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_five_steps_match_float64(backend, shape, dtype):
    run_steps(backend, shape, dtype, OPTIONS["all"], steps=5)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", [(7,), (4097,), (3, 5), (17, 33)], ids=_shape_id)
def test_large_eps0_with_zero_gradients_matches_float64(backend, shape, dtype):
    """eps[0] = 0.25, where the default 1e-30 vanishes beside any g*g in fp32: u = g*g + eps0
    on the 1-D and factored paths alike, every third gradient element zero from zero moments
    (u is eps0 alone there; without it a 1-D v is 0 and the update 0/0), two steps."""
    eps = (0.25, EPS[1])
    param = make_param(shape, dtype)
    state = init_adalomo_state(param)
    for t in (1, 2):
        grad = make_grad(shape, dtype, t)
        grad.view(-1)[::3] = 0.0
        before, prev = param.clone(), {k: v.clone() for k, v in state.items()}
        ref, ref_state, delta = adalomo_f64(before, grad, prev, lr=LR, beta2=beta2_at(t), eps=eps)
        _update_at(t, param, grad, state, backend, eps=eps)
        check_param(param, ref, before, delta, dtype)
        check_state(state, ref_state)


def test_triton_small_tiles_many_programs(monkeypatch):
    """GPU-like tiling under the interpreter: several column blocks, row groups and row
    iterations per program, so the atomics and loop bounds are exercised."""
    from lomo_kernels.ops.adalomo import triton_backend as triton_backend

    monkeypatch.setattr(triton_backend, "INTERPRETER_TILE", 256)
    monkeypatch.setattr(triton_backend, "INTERPRETER_MAX_BLOCK_N", 32)
    monkeypatch.setattr(triton_backend, "INTERPRETER_PROGRAMS", 16)
    monkeypatch.setattr(triton_backend, "VECTOR_BLOCK", 256)
    _, sizes = triton_backend._tiling(37, 100, torch.device("cpu"))
    assert sizes["BLOCK_N"] == 32 and sizes["rows_per_prog"] > sizes["BLOCK_M"]
    for shape in [(37, 100), (1000,)]:
        run_steps("triton", shape, torch.bfloat16, OPTIONS["all"], steps=2)


# ----------------------------------------------------------------------------- official code


def official_optimizer(param, *, lr, loss_scale, clip_value, clip_coef, weight_decay):
    """lomo_optim.AdaLomo around one parameter, with the state its __init__ would create but
    on the CPU (its __init__ hard-codes .cuda()); returns (optimizer, fuse_update closure)."""
    lomo_optim = require("lomo_optim")
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(param.clone())
    opt = lomo_optim.AdaLomo.__new__(lomo_optim.AdaLomo)
    opt.model, opt.lr, opt.loss_scale = model, lr, loss_scale
    opt.clip_grad_norm, opt.clip_grad_value, opt.clip_coef = 1.0, clip_value, clip_coef
    opt.weight_decay, opt.do_weight_decay = weight_decay, weight_decay > 0
    opt.eps, opt.step_num, opt.decay_rate, opt.clip_threshold = EPS, 0, -0.8, 1.0
    opt.gather_norm, opt.grad_norms = False, []
    opt.exp_avg_sq, opt.exp_avg_sq_row, opt.exp_avg_sq_col = {}, {}, {}
    if param.dim() == 1:
        opt.exp_avg_sq["weight"] = torch.zeros(param.shape[0])
    else:
        opt.exp_avg_sq_row["weight"] = torch.zeros(param.shape[0])
        opt.exp_avg_sq_col["weight"] = torch.zeros(param.shape[1])
    return opt, opt.fuse_update()


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", OFFICIAL_SHAPES, ids=_shape_id)
def test_five_steps_match_official_adalomo(backend, shape, dtype):
    """Five consecutive steps against lomo_optim.AdaLomo.fuse_update (loss scale, clip by
    value, clip_coef tensor, weight decay). The moments evolve independently on both sides;
    the official parameter is reset to ours before each step so each step is compared from
    the same starting point (different roundings would otherwise compound)."""
    param = make_param(shape, dtype)
    opt, fuse_update = official_optimizer(
        param,
        lr=LR,
        loss_scale=LOSS_SCALE,
        clip_value=1.5,
        clip_coef=torch.tensor(CLIP_COEF),
        weight_decay=0.1,
    )
    official = opt.model.weight
    state = {}
    for t in range(1, 6):
        grad = make_grad(shape, dtype, t, inv_scale=1.0 / LOSS_SCALE)
        before = param.clone()
        official.data.copy_(before)
        official.grad = grad.clone()
        opt.step_num = t  # fused_backward increments it before backward
        fuse_update(0)
        _update_at(
            t,
            param,
            grad,
            state,
            backend,
            eps=EPS,
            inv_scale=1.0 / LOSS_SCALE,
            clip_value=1.5,
            clip_coef=torch.tensor([CLIP_COEF]),
            weight_decay=0.1,
        )
        ref = official.data.double().reshape(-1)
        check_param(param, ref, before, (before.double().reshape(-1) - ref).abs(), dtype)
        if len(shape) == 1:
            ref_state = {"exp_avg_sq": opt.exp_avg_sq["weight"].double()}
        else:
            ref_state = {
                "exp_avg_sq_row": opt.exp_avg_sq_row["weight"].double(),
                "exp_avg_sq_col": opt.exp_avg_sq_col["weight"].double(),
            }
        check_state(state, ref_state)


# ----------------------------------------------------------------------------- pass A, moments


@pytest.mark.parametrize("options", OPTIONS.keys())
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", FACTORED_SHAPES, ids=_shape_id)
def test_pass_a_sums_match_float64(backend, shape, dtype, options):
    check_pass_a(backend, shape, dtype, OPTIONS[options])


@pytest.mark.parametrize("value", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_pass_a_non_finite_gradient_sets_the_measured_flag(backend, value):
    param = make_param((17, 33), torch.bfloat16)
    grad = make_grad((17, 33), torch.bfloat16, 1)
    grad[16, 32] = value
    workspace, found_inf = adalomo_workspace(param), torch.zeros(1)
    adalomo_factored_stats_(grad, param, workspace, found_inf=found_inf, backend=backend)
    assert measured_view(workspace)[1].item() == 1.0 and found_inf.item() == 1.0
    # skip_if: the tensor is marked skipped, found_inf is not raised.
    workspace, found_inf = adalomo_workspace(param), torch.zeros(1)
    adalomo_factored_stats_(
        grad, param, workspace, found_inf=found_inf, skip_if=torch.ones(1), backend=backend
    )
    assert measured_view(workspace)[1].item() == 1.0 and found_inf.item() == 0.0


@pytest.mark.parametrize("coef", [None, 0.37, 0.0], ids=["no_coef", "coef", "zero_coef"])
@pytest.mark.parametrize("rows,cols", [(1, 1), (3, 5), (1000, 1030), (2051, 7)])
def test_moments_apply_coefficient_and_eps0(backend, rows, cols, coef):
    check_moments(backend, rows, cols, coef)


# ----------------------------------------------------------------------------- overflow, skip


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().view(torch.uint8)


def _snapshot(param, state):
    return _bits(param), {k: _bits(v) for k, v in state.items()}


def _assert_unchanged(param, state, snapshot):
    p_bits, s_bits = snapshot
    assert torch.equal(_bits(param), p_bits), "parameter changed"
    for key, bits in s_bits.items():
        assert torch.equal(_bits(state[key]), bits), f"{key} changed"


@pytest.mark.parametrize("value", [float("inf"), float("nan")], ids=["inf", "nan"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", [(4097,), (17, 33), (64, 4097)], ids=_shape_id)
def test_non_finite_gradient_leaves_tensor_untouched(backend, shape, dtype, value):
    """A non-finite gradient (on the first step with zero moments, and later) leaves the
    parameter and its moments bit-identical and raises found_inf; a good step afterwards
    matches the float64 model."""
    kwargs, model = call_kwargs(OPTIONS["all"])
    param, state = make_param(shape, dtype), init_adalomo_state(make_param(shape, dtype))
    index = 0 if math.isnan(value) else param.numel() - 1  # first element, or the tail
    for t, poisoned in [(1, True), (1, False), (2, True)]:
        grad = make_grad(shape, dtype, t, kwargs["inv_scale"])
        if poisoned:
            grad.view(-1)[index] = value
        snapshot = _snapshot(param, state)
        prev_state = {k: v.clone() for k, v in state.items()}
        found_inf = torch.zeros(1)
        _update_at(t, param, grad, state, backend, found_inf=found_inf, **kwargs)
        assert found_inf.item() == float(poisoned)
        if poisoned:
            _assert_unchanged(param, state, snapshot)
        else:
            before = param.clone()
            before.view(torch.uint8).copy_(snapshot[0])
            ref, ref_state, delta = adalomo_f64(
                before, grad, prev_state, lr=LR, beta2=beta2_at(t), **model
            )
            check_param(param, ref, before, delta, dtype)
            check_state(state, ref_state)


@pytest.mark.parametrize("shape", [(4097,), (17, 33)], ids=_shape_id)
def test_skip_if_writes_nothing(backend, shape):
    dtype = torch.bfloat16
    param, state = make_param(shape, dtype), {}
    adalomo_update_(param, make_grad(shape, dtype, 1), state, lr=LR, beta2=0.0, backend=backend)
    grad = make_grad(shape, dtype, 2)
    grad.view(-1)[3] = float("nan")  # a skipped call must not even report it
    snapshot = _snapshot(param, state)
    found_inf = torch.zeros(1)
    for skip_value in (1.0, -2.0, float("nan")):
        adalomo_update_(
            param,
            grad,
            state,
            lr=LR,
            beta2=0.5,
            weight_decay=0.1,
            found_inf=found_inf,
            skip_if=torch.tensor([skip_value]),
            backend=backend,
        )
        _assert_unchanged(param, state, snapshot)
        assert found_inf.item() == 0.0

    def second_step(found_inf: torch.Tensor, skip_if: torch.Tensor) -> None:
        grad = make_grad(shape, dtype, 2)
        adalomo_update_(
            param, grad, state, lr=LR, beta2=0.5, found_inf=found_inf, skip_if=skip_if,
            backend=backend,
        )  # fmt: skip

    # The GradScaler pattern: one flag as both skip_if and found_inf, already raised.
    flag = torch.ones(1)
    second_step(flag, flag)
    _assert_unchanged(param, state, snapshot)
    assert flag.item() == 1.0
    # skip_if == 0 updates normally.
    second_step(found_inf, torch.zeros(1))
    assert not torch.equal(_bits(param), snapshot[0])
    assert found_inf.item() == 0.0


def test_bf16_result_is_round_to_nearest_even(backend):
    """bf16 parameters are rounded on the bit pattern, like _rounding.fp32_to_bf16_bits."""
    shape = (16, 64)
    param, state = make_param(shape, torch.bfloat16), {}
    grad = make_grad(shape, torch.float32, 1)
    before = param.clone()
    ref, _, _ = adalomo_f64(before, grad, init_adalomo_state(param), lr=LR, beta2=0.0)
    adalomo_update_(param, grad, state, lr=LR, beta2=0.0, backend=backend)
    # Rounding the float64 model to bf16 must agree except where the exact value lies within
    # the fp32 noise of a rounding boundary (a truncating kernel would miss ~half of them).
    expected = ref.to(torch.bfloat16)
    differ = param.reshape(-1) != expected
    near_tie = (ref - ref.to(torch.bfloat16).double()).abs() > 0.49 * ulp(ref, torch.bfloat16)
    assert not (differ & ~near_tie).any()


# ----------------------------------------------------------------------------- structure


class _RecordOps(TorchDispatchMode):
    """Records every aten / custom op called at this level and the largest tensor it
    allocated (views and in-place results share an input's storage and do not count)."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        storages = {a.untyped_storage().data_ptr() for a in inputs}
        outs = out if isinstance(out, (tuple, list)) else (out,)
        numel = max(
            (
                o.numel()
                for o in outs
                if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in storages
            ),
            default=0,
        )
        self.calls.append((str(func), numel))
        return out


@pytest.mark.parametrize("shape", [(64, 4097), (2, 3, 7), (4097,)], ids=_shape_id)
def test_launches_and_single_workspace(backend, shape):
    """One zeroed workspace allocation, then one op (one launch) per pass; no host sync."""
    param, grad = make_param(shape, torch.bfloat16), make_grad(shape, torch.bfloat16, 1)
    state = init_adalomo_state(param)
    scalars = {
        "lr": torch.tensor([LR]),
        "beta2": torch.tensor([0.5]),
        "clip_coef": torch.tensor([0.5]),
        "found_inf": torch.zeros(1),
        "skip_if": torch.zeros(1),
    }
    recorder = _RecordOps()
    with recorder:
        adalomo_update_(param, grad, state, backend=backend, **scalars)
    names = [name for name, _ in recorder.calls]
    ops = [n for n in names if n.startswith("lomo_kernels.")]
    allocs = [n for n in names if not n.startswith("lomo_kernels.")]
    if len(shape) >= 2:
        assert ops == [
            "lomo_kernels.adalomo_factored_stats_.default",
            "lomo_kernels.adalomo_factored_moments_.default",
            "lomo_kernels.adalomo_factored_norm_.default",
            "lomo_kernels.adalomo_factored_apply_.default",
        ]
    else:
        assert ops == [
            "lomo_kernels.adalomo_vector_stats_.default",
            "lomo_kernels.adalomo_vector_apply_.default",
        ]
    assert allocs == ["aten.zeros.default"], allocs
    assert not any("_local_scalar_dense" in n or "is_nonzero" in n for n in names)


@pytest.mark.parametrize("shape", [(64, 4097), (1, 70000), (200000,)], ids=_shape_id)
def test_reference_backend_is_chunked_and_sync_free(shape):
    """The torch backend never materialises an fp32 tensor of the parameter's size and never
    reads a device value on the host."""
    param, grad = make_param(shape, torch.bfloat16), make_grad(shape, torch.bfloat16, 1)
    assert param.numel() > reference.CHUNK
    state, workspace = init_adalomo_state(param), adalomo_workspace(param)
    # (inv_scale, clip_value, clip_coef), (lr, eps1, clip_threshold, weight_decay), beta2:
    # the runtime scalars as the 1-element fp32 tensors the backends take (None: 1).
    grad_args = (None, 0.5, torch.tensor([0.5]))
    step_args = (torch.tensor([LR]), 1e-3, 1.0, 0.1)
    beta2 = torch.tensor([0.5])
    # Stochastic rounding where the dtype has it: its random bits are tile-sized too.
    rounding = (param.dtype != torch.float32, 7, torch.tensor([3], dtype=torch.int64))
    found_inf = torch.zeros(1)
    recorder = _RecordOps()
    with recorder:
        if len(shape) >= 2:
            row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
            reference.factored_stats_(
                grad, param, workspace, found_inf, None, shape[-1], *grad_args[:2], 0
            )
            reference.factored_moments_(row, col, workspace, beta2, grad_args[2], 1e-30)
            reference.factored_norm_(grad, row, col, workspace, *grad_args, 0)
            reference.factored_apply_(
                param, grad, row, col, workspace, *step_args, *grad_args, *rounding, 0
            )
        else:
            v = state["exp_avg_sq"]
            reference.vector_stats_(
                grad, param, v, workspace, found_inf, None, beta2, 1e-30, *grad_args
            )
            reference.vector_apply_(
                param,
                grad,
                v,
                workspace,
                beta2,
                1e-30,
                *step_args,
                *grad_args,
                *rounding,
                0,
                param.numel(),
            )
    vectors = workspace.numel()
    largest = max(numel for _, numel in recorder.calls)
    assert largest <= max(reference.CHUNK, vectors), largest
    names = [name for name, _ in recorder.calls]
    assert not any("_local_scalar_dense" in n or "is_nonzero" in n for n in names)


def test_compiled_step_matches_eager_without_graph_breaks():
    """The passes are opaque custom ops: a compiled step traces with fullgraph=True and
    device-tensor lr/beta2 values do not recompile."""
    torch._dynamo.reset()

    def step(param, grad, state, lr, beta2, found_inf):
        adalomo_update_(
            param,
            grad,
            state,
            lr=lr,
            beta2=beta2,
            found_inf=found_inf,
            weight_decay=0.1,
            backend="cpp",
        )
        return found_inf + 0

    compiles = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, fullgraph=True, backend=compiles)
    for shape in [(17, 33), (100,)]:
        p_eager = make_param(shape, torch.bfloat16)
        p_comp = p_eager.clone()
        s_eager, s_comp = init_adalomo_state(p_eager), init_adalomo_state(p_comp)
        for t in range(1, 4):
            grad = make_grad(shape, torch.bfloat16, t)
            lr, beta2 = torch.tensor([LR]), torch.tensor([beta2_at(t)])
            step(p_eager, grad, s_eager, lr, beta2, torch.zeros(1))
            compiled(p_comp, grad, s_comp, lr, beta2, torch.zeros(1))
            if t == 1:
                first_step_compiles = compiles.frame_count
        # The shape's first step compiled (a new shape may); its later lr/beta2 did not.
        assert first_step_compiles >= 1 and compiles.frame_count == first_step_compiles
        assert torch.equal(p_eager, p_comp)
        assert all(torch.equal(s_eager[k], s_comp[k]) for k in s_eager)


def test_init_state_shapes():
    assert {k: tuple(v.shape) for k, v in init_adalomo_state(torch.empty(4, 5, 6)).items()} == {
        "exp_avg_sq_row": (20,),
        "exp_avg_sq_col": (6,),
    }
    assert {k: tuple(v.shape) for k, v in init_adalomo_state(torch.empty(9)).items()} == {
        "exp_avg_sq": (9,)
    }
    state = init_adalomo_state(torch.empty(3, 2, dtype=torch.bfloat16))
    assert all(v.dtype == torch.float32 and not v.any() for v in state.values())


def test_invalid_state_is_rejected_before_anything_is_written():
    param, grad = make_param((4, 5), torch.float32), make_grad((4, 5), torch.float32, 1)
    before = param.clone()
    with pytest.raises(ValueError, match="exp_avg_sq_col"):
        adalomo_update_(
            param,
            grad,
            {"exp_avg_sq_row": torch.zeros(4), "exp_avg_sq_col": torch.zeros(4)},
            lr=LR,
            beta2=0.5,
        )
    with pytest.raises(ValueError, match="beta2"):
        adalomo_update_(param, grad, {}, lr=LR, beta2=1.5)
    assert torch.equal(param, before)


def test_unavailable_backend_warns_once_and_falls_back():
    backends.ADALOMO.warned.discard(("cpp", "meta"))
    backends.ADALOMO.cache.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = backends.ADALOMO.resolve(torch.device("meta"), "cpp")
        backends.ADALOMO.cache.clear()
        second = backends.ADALOMO.resolve(torch.device("meta"), "cpp")
    assert first is reference and second is reference
    assert sum("AdaLomo backend 'cpp' unavailable" in str(w.message) for w in caught) == 1


# ----------------------------------------------------------------------------- GPU builds


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and Path(root, "bin", "nvcc").exists():
            return str(Path(root, "bin", "nvcc"))
    return None


@pytest.mark.parametrize("arch", [80, 90])
def test_cuda_kernels_compile_with_nvcc(arch, tmp_path):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    result = subprocess.run(
        [
            nvcc,
            "-std=c++17",
            "-O3",
            "-c",
            str(CSRC / "adalomo_cuda.cu"),
            "-I",
            str(CSRC),
            "-gencode",
            f"arch=compute_{arch},code=sm_{arch}",
            "-Xptxas",
            "-warn-spills",
            "-o",
            str(tmp_path / "adalomo_cuda.o"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "spill" not in result.stderr.lower(), result.stderr[-4000:]


_AOT_SCRIPT = r"""
import os, re, subprocess, tempfile
import triton
from triton.backends.compiler import GPUTarget
from lomo_kernels.kernels.triton import adalomo_kernels as k

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                         "cuobjdump")


def local_bytes(cubin):
    # Local memory of the machine code (ptxas spills), when the tool is available.
    if not os.path.exists(CUOBJDUMP):
        return 0
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True,
                               text=True).stdout
    return max((int(x) for x in re.findall(r"LOCAL:(\d+)", usage)), default=0)


types = {"grad_ptr": "*i16", "param_ptr": "*i16", "ws_ptr": "*fp32",
         "found_inf_ptr": "*fp32", "skip_if_ptr": "*fp32", "row_state_ptr": "*fp32",
         "col_state_ptr": "*fp32", "v_ptr": "*fp32", "lr_ptr": "*fp32",
         "beta2_ptr": "*fp32", "inv_scale_ptr": "*fp32",
         "clip_coef_ptr": "*fp32", "rows": "i64", "cols": "i64",
         "rows_per_prog": "i64", "n_row_blocks": "i64", "n": "i64", "offset": "i64",
         "seed_step_ptr": "*i64", "seed_lo": "i32", "seed_hi": "i32"}
flags = {"GRAD_KIND": 2, "PARAM_KIND": 2, "HAS_CLIP_VALUE": True, "HAS_CLIP_COEF": True}
grad_flags = {f: v for f, v in flags.items() if f != "PARAM_KIND"}
stats_flags = {f: v for f, v in flags.items() if f != "HAS_CLIP_COEF"}  # the moments apply it
tiles = {"BLOCK_M": 16, "BLOCK_N": 256}
cases = [
    (k.factored_stats_kernel, {**stats_flags, **tiles}),
    (k.factored_moments_kernel, {"BLOCK": 1024}),
    (k.factored_moments_kernel, {"BLOCK": 1024, "clip_coef_ptr": None}),  # no coefficient
    (k.factored_norm_kernel, {**grad_flags, **tiles}),
    (k.factored_apply_kernel, {**flags, **tiles, "STOCHASTIC_ROUNDING": True}),
    (k.vector_stats_kernel, {**flags, "BLOCK": 4096}),
    (k.vector_apply_kernel, {**flags, "BLOCK": 4096, "STOCHASTIC_ROUNDING": True}),
]
for kernel, constexprs in cases:
    # Every pointer parameter has its type above (an unknown name would compile as fp32).
    unknown = [p.name for p in kernel.params if p.name.endswith("_ptr") and p.name not in types]
    assert not unknown, (kernel, unknown)
    signature = {p.name: "constexpr" if p.name in constexprs else types.get(p.name, "fp32")
                 for p in kernel.params}
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 8})
    assert ".entry" in compiled.asm["ptx"], kernel
    # Nothing in local memory: neither in the PTX nor spilled by ptxas.
    assert not re.search(r"\.local\b", compiled.asm["ptx"]), kernel
    assert local_bytes(compiled.asm["cubin"]) == 0, kernel
print("compiled", len(cases))
"""


def test_triton_kernels_compile_for_sm90():
    """Ahead-of-time compilation for a GPU target (no GPU needed): catches code the
    interpreter accepts but the compiler rejects, and local memory (register spills). A fresh
    process, since this one decorated the kernels for the interpreter."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    result = subprocess.run(
        [sys.executable, "-c", _AOT_SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "compiled 7" in result.stdout
