"""On a CUDA device: every backend against the float64 model, the optimizers end to end, and
the no-host-sync check with CUDA tensors. `make test-gpu` runs these (TRITON_INTERPRET=0, so
Triton compiles real GPU kernels); without a GPU they are skipped with the reason."""

from __future__ import annotations

import os

import pytest
import torch
from support import int8_device_cases as int8_cases
from support.adalomo import FACTORED_SHAPES, check_moments, check_pass_a
from support.adalomo import OPTIONS as ADALOMO_OPTIONS
from support.adalomo_write_back import (
    ROUNDING_SEEDS,
    adalomo_write_back,
    assert_same_write_back,
    edge_write_back_case,
)
from support.float64 import assert_within_ulp, lomo_update_f64
from support.fp16_edges import fp16_any_value_case, fp16_edge_case, fp16_subnormal_tie_case
from support.host_sync import NoHostSync, guarded_fused_backward
from support.int8_compare import check_stochastic_ties
from support.lomo_bitwise import assert_same_bits, run_update
from support.lomo_update import LR, OPTIONS, bound_kwargs, make_inputs
from support.models import batch, max_rel_diff, tiny_llama

from lomo_kernels import AdaLomo, Lomo, ops
from lomo_kernels.ops import backends
from lomo_kernels.ops.adalomo import reference as adalomo_reference
from lomo_kernels.ops.lomo import reference as lomo_reference

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="no CUDA device here: these run on a GPU machine with `make test-gpu`",
    ),
]
DEVICE = "cuda"
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SR_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # stochastic rounding applies
SIZES = [1, 15, 4097, 278011, 2**22 + 3]


@pytest.fixture(params=["triton", "cpp", "torch"])
def cuda_backend(request) -> str:
    if request.param == "triton" and os.environ.get("TRITON_INTERPRET") == "1":
        pytest.fail("TRITON_INTERPRET=1 would time/verify the interpreter: run `make test-gpu`")
    module, reason = backends.LOMO.load(request.param, "cuda")
    if module is None:
        pytest.fail(f"backend {request.param} must serve CUDA tensors on a GPU machine: {reason}")
    return request.param


@pytest.mark.gpu_smoke
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


@pytest.mark.gpu_smoke
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_triton_bound_launch_equals_the_jit_launch_on_cuda(dtype):
    """The second launch of a specialisation goes straight to the compiled kernel
    (kernels/triton/bound_launch.py): bit for bit what the JIT's launch wrote, and taken."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.fail("TRITON_INTERPRET=1 would test the interpreter: run `make test-gpu`")
    from lomo_kernels.ops.lomo import triton_backend

    param, grad = make_inputs(4097, dtype, dtype)
    g, lr = grad.to(DEVICE), torch.tensor([LR], device=DEVICE)
    found_inf = torch.zeros(1, device=DEVICE)
    args = (g, lr, None, None, None, 0.01, found_inf, None, False, 0, None, 0)
    triton_backend.lomo_update_(param.to(DEVICE), *args)  # the launcher set up
    _, bound = triton_backend.lomo_update_.bound
    bound.compiled.clear()
    by_jit, bound_launch = param.to(DEVICE), param.to(DEVICE)
    triton_backend.lomo_update_(by_jit, *args)  # through the JIT, then remembered
    triton_backend.lomo_update_(bound_launch, *args)  # straight to the compiled kernel
    torch.cuda.synchronize()
    assert len(bound.compiled) == 1 and bound.refused is None
    assert torch.equal(bound_launch.view(torch.uint8), by_jit.view(torch.uint8))
    assert not torch.equal(bound_launch.cpu(), param)


@pytest.mark.parametrize("where", [0, 2048, -1])
def test_non_finite_gradient_flags_and_keeps_param_on_cuda(cuda_backend, where):
    param, grad = make_inputs(4097, torch.bfloat16, torch.bfloat16)
    grad[where] = float("nan")
    p, g = param.to(DEVICE), grad.to(DEVICE)
    found_inf = torch.zeros(1, device=DEVICE)
    ops.fused_sgd_update_(p, g, lr=LR, found_inf=found_inf, backend=cuda_backend)
    assert found_inf.item() == 1.0
    assert p[where].cpu().view(torch.int16) == param[where].view(torch.int16)


@pytest.mark.gpu_smoke
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_grad_sumsq_matches_float64_on_cuda(cuda_backend, dtype):
    grad = torch.randn(278011, generator=torch.Generator().manual_seed(1)).to(dtype)
    sumsq = torch.zeros(1, device=DEVICE)
    ops.grad_sumsq_(grad.to(DEVICE), sumsq, inv_scale=0.5, backend=cuda_backend)
    ref = float((grad.double() * 0.5).pow(2).sum())
    # fp32 accumulation of n positive terms: relative error <= n * 2**-24 in the worst case;
    # tree reductions stay far below, 1e-5 bounds both orders used by the backends.
    assert float(sumsq) == pytest.approx(ref, rel=1e-5)


@pytest.mark.gpu_smoke
@pytest.mark.parametrize("dtype", SR_DTYPES.values(), ids=SR_DTYPES.keys())
@pytest.mark.parametrize("step", [None, 7, 2**40 + 3], ids=["no_step", "step", "big_step"])
def test_stochastic_rounding_seed_step_read_on_cuda(cuda_backend, step, dtype):
    """The kernel reads seed_step from device memory (no host sync) and rounds as the CPU
    reference does, bit for bit (p - 1 * g is one fp32 rounding with or without an FMA)."""
    n = 278011
    param = torch.ones(n, dtype=dtype)
    grad = torch.full((n,), -0.3 * 2.0**-7)  # between neighbours of bf16 and of fp16
    options = dict(lr=1.0, stochastic_rounding=True, seed=99)
    expected = param.clone()
    cpu_step = None if step is None else torch.tensor([step])
    ops.fused_sgd_update_(expected, grad, seed_step=cpu_step, backend="torch", **options)
    p, g = param.to(DEVICE), grad.to(DEVICE)
    seed_step = None if cpu_step is None else cpu_step.to(DEVICE)
    with NoHostSync():
        ops.fused_sgd_update_(p, g, seed_step=seed_step, backend=cuda_backend, **options)
    assert torch.equal(p.cpu().view(torch.int16), expected.view(torch.int16))
    assert not torch.equal(p.cpu(), torch.ones_like(expected))  # some rounded up


def _to_device(value):
    return value.to(DEVICE) if isinstance(value, torch.Tensor) else value


def _lomo_sr_on_cuda(cuda_backend, param, grad, opts, seed, step):
    """The CPU reference's stochastically rounded update and the backend's on the GPU (found
    flags too); seed_step read on the device."""
    expected, found_ref = param.clone(), torch.zeros(1)
    run_update(
        lomo_reference, expected, grad, opts, found=found_ref, sr=True, seed=seed, seed_step=step
    )
    p, g, found = param.to(DEVICE), grad.to(DEVICE), torch.zeros(1, device=DEVICE)
    with NoHostSync():
        ops.fused_sgd_update_(
            p, g, lr=torch.tensor([opts["lr"]], device=DEVICE), inv_scale=opts["inv_scale"],
            clip_value=opts["clip_value"], clip_coef=opts["clip_coef"],
            weight_decay=opts["weight_decay"], found_inf=found, stochastic_rounding=True,
            seed=seed, seed_step=_to_device(step), backend=cuda_backend,
        )  # fmt: skip
    return (p.cpu(), expected), (found.cpu(), found_ref)


@pytest.mark.parametrize("gdt", ["same", "fp32"])
@pytest.mark.parametrize("pdt", SR_DTYPES.keys())
def test_stochastic_rounding_edge_values_on_cuda(cuda_backend, pdt, gdt):
    """fp16's boundaries (subnormals, 2^-14, 65504, inf, nan, -0.0) in the first vector, a
    middle one, one with a non-finite gradient and the tail (support/fp16_edges.py):
    the CPU reference's bits, seeded with and without a per-step value."""
    param, grad, opts = fp16_edge_case(pdt, pdt if gdt == "same" else gdt)
    for seed, step in ROUNDING_SEEDS:
        (got, want), (found, found_ref) = _lomo_sr_on_cuda(
            cuda_backend, param, grad, opts, seed, step
        )
        assert_same_bits(got, want)
        assert found.item() == found_ref.item() == 1.0


def test_fp16_subnormal_ties_on_cuda(cuda_backend):
    # Every element's update a tie of fp16's subnormal rounding (support/fp16_edges.py): down
    # for an odd random value, up for an even one, as the reference.
    for seed, step in ROUNDING_SEEDS:
        param, grad, opts, expected = fp16_subnormal_tie_case(4099, seed, step)
        (got, want), _ = _lomo_sr_on_cuda(cuda_backend, param, grad, opts, seed, step)
        assert_same_bits(got, want)
        assert_same_bits(want, expected)


def test_fp16_stochastic_rounding_of_any_fp32_value_on_cuda(cuda_backend):
    param, grad, opts = fp16_any_value_case(2**20 + 3, seed=6)
    for seed, step in ROUNDING_SEEDS:
        (got, want), _ = _lomo_sr_on_cuda(cuda_backend, param, grad, opts, seed, step)
        assert_same_bits(got, want)


@pytest.fixture(params=["triton", "cpp", "torch"])
def adalomo_cuda_module(request):
    """The AdaLomo backend module that serves CUDA tensors (its passes by spec name)."""
    if request.param == "triton" and os.environ.get("TRITON_INTERPRET") == "1":
        pytest.fail("TRITON_INTERPRET=1 would time/verify the interpreter: run `make test-gpu`")
    module, reason = backends.ADALOMO.load(request.param, "cuda")
    if module is None:
        pytest.fail(f"backend {request.param} must serve CUDA tensors on a GPU machine: {reason}")
    return module


@pytest.mark.gpu_smoke
@pytest.mark.parametrize("shape", [(65_557,), (37, 1031)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("gdt", ["same", "fp32"])
@pytest.mark.parametrize("pdt", SR_DTYPES.keys())
def test_adalomo_write_back_stochastic_rounding_on_cuda(adalomo_cuda_module, pdt, gdt, shape):
    """AdaLomo's write-back (factored and 1-D) rounding fp16's boundary values
    stochastically, as the CPU reference does, bit for bit: moments of 1 and a synthesized
    workspace make every factor exact (rsqrt(1) = 1), so the new values are p - lr_t * g
    (support.adalomo_write_back.edge_write_back_case); seed_step read on the device."""
    *inputs, hyper = edge_write_back_case(pdt, pdt if gdt == "same" else gdt, shape)
    param, grad, state, workspace = inputs
    cuda_state = {key: value.to(DEVICE) for key, value in state.items()}
    cuda_hyper = {key: _to_device(value) for key, value in hyper.items()}
    for seed, step in ROUNDING_SEEDS:
        want = adalomo_write_back(
            adalomo_reference, *inputs, sr=True, seed=seed, seed_step=step, **hyper
        )
        with NoHostSync():
            p, s = adalomo_write_back(
                adalomo_cuda_module, param.to(DEVICE), grad.to(DEVICE), cuda_state,
                workspace.to(DEVICE), sr=True, seed=seed, seed_step=_to_device(step),
                **cuda_hyper,
            )  # fmt: skip
        got = (p.cpu(), {key: value.cpu() for key, value in s.items()})
        assert_same_write_back(got, want, any_nan=True)


@pytest.mark.gpu_smoke
@pytest.mark.parametrize("options", ADALOMO_OPTIONS.keys())
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", FACTORED_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_adalomo_pass_a_matches_float64_on_cuda(cuda_backend, shape, dtype, options):
    check_pass_a(cuda_backend, shape, dtype, ADALOMO_OPTIONS[options], device=DEVICE)


@pytest.mark.gpu_smoke
@pytest.mark.parametrize("coef", [None, 0.37, 0.0], ids=["no_coef", "coef", "zero_coef"])
@pytest.mark.parametrize("rows,cols", [(1, 1), (3, 5), (1000, 1030), (2051, 7)])
def test_adalomo_moments_match_float64_on_cuda(cuda_backend, rows, cols, coef):
    check_moments(cuda_backend, rows, cols, coef, device=DEVICE)


def _cuda_batch(step: int) -> dict[str, torch.Tensor]:
    return {k: v.to(DEVICE) for k, v in batch(step).items()}


@pytest.mark.gpu_smoke
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


@pytest.mark.gpu_smoke
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
        guarded_fused_backward(opt, loss)  # and on the fast path
    opt.flush_report()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert float(model(**_cuda_batch(0)).loss) < first
    assert all(v.is_cuda for s in opt.state.values() for v in s.values() if torch.is_tensor(v))


@pytest.mark.gpu_smoke
@pytest.mark.parametrize("grad_dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("buffer_dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_grad_accumulate_matches_the_reference_on_cuda(
    cuda_backend, buffer_dtype, grad_dtype, stochastic
):
    """The accumulate pass on CUDA stores the reference's bits (one fp32 add, then the
    write-back's rounding from the same key), its sum of squares within fp32 summation."""
    if stochastic and buffer_dtype == torch.float32:
        pytest.skip("fp32 buffers store the sum exactly: nothing to round")
    gen = torch.Generator().manual_seed(3)
    n = 278011
    buffer = torch.randn(n, generator=gen).to(buffer_dtype)
    grad = (torch.randn(n, generator=gen) * 1e-2).to(grad_dtype)
    step = torch.tensor([12345], dtype=torch.int64)
    results = []
    for device, backend in (("cpu", "torch"), (DEVICE, cuda_backend)):
        out, sumsq, found = (
            buffer.to(device),
            torch.zeros(1, device=device),
            torch.zeros(1, device=device),
        )
        ops.grad_accumulate_(out, grad.to(device), inv_scale=0.5, sumsq=sumsq, found_inf=found,
                             stochastic_rounding=stochastic, seed=7, seed_step=step.to(device),
                             backend=backend)  # fmt: skip
        results.append((out.cpu(), float(sumsq), float(found)))
    (ref, ref_sumsq, ref_found), (got, got_sumsq, got_found) = results
    assert torch.equal(ref.view(-1).float(), got.view(-1).float()) and got_found == ref_found == 0
    # fp32 accumulation of n positive terms against the reference's float64 sum (as above).
    assert got_sumsq == pytest.approx(ref_sumsq, rel=1e-5)


@pytest.mark.gpu_smoke
@pytest.mark.parametrize("op", ["update", "accumulate"])
def test_slices_at_their_offsets_on_cuda(cuda_backend, op):
    """A bf16 parameter's slices, each at its flat offset (one element; a pair of the
    accumulation's stream split; 5 past a multiple of 32; the rest), store on CUDA what one
    call on the whole tensor stores, bit for bit the reference's; a slice past 2**32 too."""
    gen = torch.Generator().manual_seed(4)
    n, cuts = 70001, [0, 1, 18, 2085, 70001]
    values = torch.randn(n, generator=gen).to(torch.bfloat16)
    grad = torch.randn(n, generator=gen) * 1e-2
    step = torch.tensor([77], dtype=torch.int64)

    def run(device, backend, target, g, offset):
        rounding = dict(stochastic_rounding=True, seed=2**40 + 5,
                        seed_step=step.to(device), offset=offset, backend=backend)  # fmt: skip
        if op == "update":
            ops.fused_lomo_update_(target, g.to(device), lr=0.1, weight_decay=0.01, **rounding)
        else:
            ops.grad_accumulate_(target, g.to(device, torch.bfloat16), **rounding)

    whole, sliced = values.to(DEVICE), values.to(DEVICE)
    run(DEVICE, cuda_backend, whole, grad, 0)
    for a, b in zip(cuts, cuts[1:], strict=False):
        run(DEVICE, cuda_backend, sliced[a:b], grad[a:b], a)
    reference = values.clone()
    run("cpu", "torch", reference, grad, 0)
    assert torch.equal(sliced.cpu().view(torch.int16), whole.cpu().view(torch.int16))
    assert torch.equal(whole.cpu().view(torch.int16), reference.view(torch.int16))
    far, far_reference = values[:4099].to(DEVICE), values[:4099].clone()
    run(DEVICE, cuda_backend, far, grad[:4099], 2**32 - 45)
    run("cpu", "torch", far_reference, grad[:4099], 2**32 - 45)
    assert torch.equal(far.cpu().view(torch.int16), far_reference.view(torch.int16))


@pytest.mark.gpu_smoke
@pytest.mark.parametrize("cls", [Lomo, AdaLomo], ids=["lomo", "adalomo"])
def test_accumulation_trains_on_cuda_without_host_sync(cls):
    model = tiny_llama(torch.bfloat16).to(DEVICE)
    lr = 0.05 if cls is Lomo else 1e-2
    opt = cls(model, lr=lr, clip_grad_norm=1.0, accumulation_steps=4)
    first = float(model(**_cuda_batch(0)).loss)
    for step in range(40):
        loss = model(**_cuda_batch(step % 2)).loss / 4
        with NoHostSync():
            opt.fused_backward(loss)
    opt.flush_report()
    assert opt.step_count == 10
    assert float(model(**_cuda_batch(0)).loss) < first


# ----------------------------------------------------------------------------- 8-bit buffer
# The CUDA extension's grad_accumulate_int8_, lomo_update_int8_ and int8_dequantize_
# (csrc/lomo_cuda.cu) against the reference on the CPU, bit for bit
# (support/int8_device_cases.py): every size and offset, each with every gradient or parameter
# dtype in one test, so the grid stays a few hundred launches.


@pytest.fixture(scope="module")
def int8_cuda():
    """The CUDA C++ extension (its 8-bit buffer ops, called positionally as the reference)."""
    from lomo_kernels.ops.lomo import cpp_backend

    module = cpp_backend._loader.get("cuda")
    if module is None:
        pytest.fail(f"the CUDA extension must build on a GPU machine: "
                    f"{cpp_backend.unavailable_reason('cuda')}")  # fmt: skip
    return module


@pytest.mark.gpu_smoke
@pytest.mark.parametrize("layout", int8_cases.LAYOUTS)
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("offset", int8_cases.OFFSETS, ids=lambda o: f"at{o}")
def test_int8_accumulate_matches_the_reference_on_cuda(int8_cuda, offset, stochastic, layout):
    for n in int8_cases.sizes_at(offset, large=layout == "fresh"):
        for dtype in int8_cases.DTYPES.values():
            int8_cases.check_accumulate(int8_cuda, DEVICE, n, offset, dtype, stochastic, layout)


@pytest.mark.parametrize(("size", "offset"), [(257, 0), (278011, 300), (4097, 2**32 + 5)])
def test_int8_accumulate_stochastic_ties_on_cuda(int8_cuda, size, offset):
    """Every element a tie of the stochastic rounding (x + u half-way between codes): the
    even code, as the reference (support/int8_compare.py)."""
    for step in (None, torch.tensor([5], dtype=torch.int64)):
        check_stochastic_ties(int8_cuda, size, offset, step, device=DEVICE)


@pytest.mark.parametrize("where", ["first", "middle", "last", "spread"])
@pytest.mark.parametrize("offset", [0, 300], ids=lambda o: f"at{o}")
def test_int8_accumulate_non_finite_blocks_on_cuda(int8_cuda, offset, where):
    """A block holding an inf/nan stores codes 0 and scale nan; found_inf is set and sumsq nan,
    as the reference does."""
    for n in (7, 257, 4097):
        for dtype in int8_cases.DTYPES.values():
            int8_cases.check_accumulate(int8_cuda, DEVICE, n, offset, dtype, True,
                                        "block_aligned", non_finite=where)  # fmt: skip


@pytest.mark.gpu_smoke
@pytest.mark.parametrize("options", int8_cases.UPDATE_OPTIONS)
@pytest.mark.parametrize("codes_shift", [0, 1], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("offset", int8_cases.OFFSETS, ids=lambda o: f"at{o}")
def test_int8_update_matches_the_reference_on_cuda(int8_cuda, offset, codes_shift, options):
    for n in int8_cases.sizes_at(offset, large=codes_shift == 0):
        for dtype in int8_cases.DTYPES.values():
            for stochastic in (False, True) if dtype != torch.float32 else (False,):
                int8_cases.check_update(int8_cuda, DEVICE, n, offset, dtype, stochastic,
                                        options, codes_shift=codes_shift)  # fmt: skip


@pytest.mark.parametrize("skip", [None, 0.0, 1.0], ids=["no_skip", "skip_0", "skip_1"])
@pytest.mark.parametrize("where", ["first", "middle", "spread"])
def test_int8_update_non_finite_and_skip_on_cuda(int8_cuda, where, skip):
    """A nan-scale block's elements keep their parameter and set found_inf; skip_if writes
    nothing and leaves found_inf alone, as the reference."""
    for dtype in int8_cases.DTYPES.values():
        int8_cases.check_update(int8_cuda, DEVICE, 4097, 300, dtype, dtype != torch.float32,
                                "full", non_finite=where, skip=skip)  # fmt: skip


@pytest.mark.parametrize("codes_shift", [0, 1], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("offset", int8_cases.OFFSETS, ids=lambda o: f"at{o}")
def test_int8_dequantize_matches_the_reference_on_cuda(int8_cuda, offset, codes_shift):
    for n in int8_cases.sizes_at(offset, large=codes_shift == 0):
        for dtype in int8_cases.DTYPES.values():
            for non_finite in (None, "middle"):
                int8_cases.check_dequantize(int8_cuda, DEVICE, n, offset, dtype, non_finite,
                                            codes_shift)  # fmt: skip
