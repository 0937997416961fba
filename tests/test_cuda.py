"""On a CUDA device: every backend against the float64 model, the optimizers end to end, and
the no-host-sync check with CUDA tensors. `make test-gpu` runs these (TRITON_INTERPRET=0, so
Triton compiles real GPU kernels); without a GPU they are skipped with the reason."""

from __future__ import annotations

import os

import pytest
import torch
from float64_reference import assert_within_ulp, lomo_update_f64
from test_adalomo_ops import FACTORED_SHAPES, check_moments, check_pass_a
from test_adalomo_ops import OPTIONS as ADALOMO_OPTIONS
from test_lomo_safety import NoHostSync
from test_update_op import LR, OPTIONS, bound_kwargs, make_inputs
from tiny_models import batch, max_rel_diff, tiny_llama

from lomo_kernels import AdaLomo, Lomo, ops
from lomo_kernels.ops import backends

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="no CUDA device here: these run on a GPU machine with `make test-gpu`",
    ),
]
DEVICE = "cuda"
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SIZES = [1, 15, 4097, 278011, 2**22 + 3]


@pytest.fixture(params=["triton", "cpp", "torch"])
def cuda_backend(request) -> str:
    if request.param == "triton" and os.environ.get("TRITON_INTERPRET") == "1":
        pytest.fail("TRITON_INTERPRET=1 would time/verify the interpreter: run `make test-gpu`")
    module, reason = backends.LOMO.load(request.param, "cuda")
    if module is None:
        pytest.fail(f"backend {request.param} must serve CUDA tensors on a GPU machine: {reason}")
    return request.param


@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"n{n}")
@pytest.mark.parametrize("grad_dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("param_dtype", DTYPES.values(), ids=DTYPES.keys())
def test_update_matches_float64_on_cuda(cuda_backend, param_dtype, grad_dtype, n):
    options = OPTIONS["all"]
    param, grad = make_inputs(n, param_dtype, grad_dtype, inv_scale=options["inv_scale"])
    ref, bad, lr_g = lomo_update_f64(param, grad, lr=LR, **options)
    original = param.clone()
    p, g = param.to(DEVICE), grad.to(DEVICE)
    found_inf = torch.zeros(1, device=DEVICE)
    lr = torch.tensor([LR], device=DEVICE)
    ops.fused_sgd_update_(p, g, lr=lr, found_inf=found_inf, backend=cuda_backend, **options)
    assert found_inf.item() == 0.0
    assert_within_ulp(p.cpu(), ref, param_dtype, **bound_kwargs(param_dtype, original, lr_g))


@pytest.mark.parametrize("where", [0, 2048, -1])
def test_non_finite_gradient_flags_and_keeps_param_on_cuda(cuda_backend, where):
    param, grad = make_inputs(4097, torch.bfloat16, torch.bfloat16)
    grad[where] = float("nan")
    p, g = param.to(DEVICE), grad.to(DEVICE)
    found_inf = torch.zeros(1, device=DEVICE)
    ops.fused_sgd_update_(p, g, lr=LR, found_inf=found_inf, backend=cuda_backend)
    assert found_inf.item() == 1.0
    assert p[where].cpu().view(torch.int16) == param[where].view(torch.int16)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_grad_sumsq_matches_float64_on_cuda(cuda_backend, dtype):
    grad = torch.randn(278011, generator=torch.Generator().manual_seed(1)).to(dtype)
    sumsq = torch.zeros(1, device=DEVICE)
    ops.grad_sumsq_(grad.to(DEVICE), sumsq, inv_scale=0.5, backend=cuda_backend)
    ref = float((grad.double() * 0.5).pow(2).sum())
    # fp32 accumulation of n positive terms: relative error <= n * 2**-24 in the worst case;
    # tree reductions stay far below, 1e-5 bounds both orders used by the backends.
    assert float(sumsq) == pytest.approx(ref, rel=1e-5)


@pytest.mark.parametrize("step", [None, 7, 2**40 + 3], ids=["no_step", "step", "big_step"])
def test_stochastic_rounding_seed_step_read_on_cuda(cuda_backend, step):
    """The kernel reads seed_step from device memory (no host sync) and rounds as the CPU
    reference does, bit for bit (p - 1 * g is one fp32 rounding with or without an FMA)."""
    n = 278011
    param = torch.ones(n, dtype=torch.bfloat16)
    grad = torch.full((n,), -0.3 * 2.0**-7)
    options = dict(lr=1.0, stochastic_rounding=True, seed=99)
    expected = param.clone()
    cpu_step = None if step is None else torch.tensor([step])
    ops.fused_sgd_update_(expected, grad, seed_step=cpu_step, backend="torch", **options)
    p, g = param.to(DEVICE), grad.to(DEVICE)
    seed_step = None if cpu_step is None else cpu_step.to(DEVICE)
    with NoHostSync():
        ops.fused_sgd_update_(p, g, seed_step=seed_step, backend=cuda_backend, **options)
    assert torch.equal(p.cpu().view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("options", ADALOMO_OPTIONS.keys())
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", FACTORED_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_adalomo_pass_a_matches_float64_on_cuda(cuda_backend, shape, dtype, options):
    check_pass_a(cuda_backend, shape, dtype, ADALOMO_OPTIONS[options], device=DEVICE)


@pytest.mark.parametrize("coef", [None, 0.37, 0.0], ids=["no_coef", "coef", "zero_coef"])
@pytest.mark.parametrize("rows,cols", [(1, 1), (3, 5), (1000, 1030), (2051, 7)])
def test_adalomo_moments_match_float64_on_cuda(cuda_backend, rows, cols, coef):
    check_moments(cuda_backend, rows, cols, coef, device=DEVICE)


def _cuda_batch(step: int) -> dict[str, torch.Tensor]:
    return {k: v.to(DEVICE) for k, v in batch(step).items()}


def test_lomo_fp32_equals_torch_sgd_on_cuda(cuda_backend):
    ours, ref = tiny_llama().to(DEVICE), tiny_llama().to(DEVICE)
    opt = Lomo(ours, lr=0.05, clip_grad_norm=0.5, backend=cuda_backend)
    sgd = torch.optim.SGD(ref.parameters(), lr=0.05)
    for step in range(4):
        opt.fused_backward(ours(**_cuda_batch(step)).loss)
        loss = ref(**_cuda_batch(step)).loss
        sgd.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        sgd.step()
    # Same math in fp32; only summation order differs (cuBLAS, the norm's reduction).
    assert max_rel_diff(ours, ref) < 1e-4


@pytest.mark.parametrize("single", [False, True], ids=["exact", "single_backward"])
@pytest.mark.parametrize("cls", [Lomo, AdaLomo], ids=["lomo", "adalomo"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_optimizers_train_on_cuda_without_host_sync(cls, dtype, single):
    model = tiny_llama(dtype).to(DEVICE)
    lr = 0.05 if cls is Lomo else 1e-2
    opt = cls(model, lr=lr, clip_grad_norm=1.0, single_backward=single)
    first = None
    for step in range(30):
        loss = model(**_cuda_batch(step % 2)).loss
        first = float(loss) if first is None else first
        with NoHostSync():
            opt.fused_backward(loss)
    opt.flush_report()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert float(model(**_cuda_batch(0)).loss) < first
    assert all(v.is_cuda for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
