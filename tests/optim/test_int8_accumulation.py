"""The 8-bit blockwise accumulation buffer (`accumulation_dtype=torch.int8`) in the
optimizers: k micro-batches through the 8-bit buffer equal torch's accumulation whose .grad
is quantised the same way after every micro-batch (a float64 model of the format written
here, not the package's), clipping and AdaLomo's statistics read the quantised sum, slices
and row blocks store what the whole buffer stores, overflow skips the step, and the buffer
takes about one byte per element."""

from __future__ import annotations

import math

import pytest
import torch
from support.accumulating import FP32_BOUND, K, micro_batches, piece_of, train_accumulating
from support.models import max_rel_diff, tiny_llama
from support.state import same_bits, snapshot, tensors, unchanged

from lomo_kernels import AdaLomo, Lomo

BLOCK = 256


def quantise_nearest(values: torch.Tensor) -> torch.Tensor:
    """What an 8-bit buffer holds for the fp32 `values` (a whole parameter, flat index from
    0), rounded to nearest even: per block of 256, the scale is the smallest power of two
    2**e (e >= -126) with max|value| <= 127 * 2**e, found in float64."""
    flat = values.detach().double().reshape(-1)
    out = torch.empty_like(flat)
    for start in range(0, flat.numel(), BLOCK):
        block = flat[start : start + BLOCK]
        absmax = block.abs().max().item()
        if absmax == 0:
            out[start : start + BLOCK] = 0.0
            continue
        e = max(-126, math.frexp(absmax / 127)[1] - 1)  # 2**e <= absmax / 127 < 2**(e+1)
        while absmax > 127 * 2.0**e:
            e += 1
        while e > -126 and absmax <= 127 * 2.0 ** (e - 1):
            e -= 1
        out[start : start + BLOCK] = torch.round(block / 2.0**e) * 2.0**e
    return out.to(values.dtype).view_as(values)


def train_torch_quantised(model, lr, clip, steps, k=K) -> list[torch.Tensor]:
    """torch's accumulation + clip_grad_norm_ + SGD, each .grad replaced after every
    micro-batch by what the 8-bit buffer holds (the buffer adds the next gradient to its
    stored values, as .grad does); each step's gradient norm."""
    sgd = torch.optim.SGD(model.parameters(), lr=lr)
    norms = []  # each step's norm before clipping
    for step in range(steps):
        for micro in micro_batches(step, k):
            (model(**micro).loss / k).backward()
            for p in model.parameters():
                p.grad = quantise_nearest(p.grad)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip or float("inf")))
        sgd.step()
        sgd.zero_grad(set_to_none=True)
    return norms


@pytest.mark.parametrize("clip", [None, 0.5])
def test_lomo_equals_torch_with_the_quantised_sum(backend, clip):
    ours, ref = tiny_llama(), tiny_llama()
    opt = Lomo(ours, lr=0.05, clip_grad_norm=clip, accumulation_steps=K, backend=backend,
               accumulation_dtype=torch.int8, stochastic_rounding=False)  # fmt: skip
    train_accumulating(ours, opt, steps=1)
    train_torch_quantised(ref, 0.05, clip, steps=1)
    assert opt.step_count == 1
    # The gradients are the same fp32 values and the quantised sums the same: only the
    # update's and the clip coefficient's rounding differ, as in test_accumulation.py. (One
    # step: a later step's gradients would differ in their last bits, which can move a code
    # by a whole step.)
    assert max_rel_diff(ours, ref) <= FP32_BOUND


def test_adalomo_reads_the_quantised_sum(backend):
    # AdaLomo with the 8-bit buffer equals AdaLomo with an fp32 buffer whose contents are
    # quantised (float64 model) after every micro-batch: its statistics read the same sum.
    from lomo_kernels.optim.accumulation import Accumulation

    ours, ref = tiny_llama(), tiny_llama()
    opt = AdaLomo(ours, lr=1e-3, clip_grad_norm=0.3, accumulation_steps=K, backend=backend,
                  accumulation_dtype=torch.int8, stochastic_rounding=False)  # fmt: skip
    emulated = AdaLomo(ref, lr=1e-3, clip_grad_norm=0.3, accumulation_steps=K,
                       accumulation_dtype=torch.float32, backend=backend)  # fmt: skip
    accumulation: Accumulation = emulated._accumulation
    add = accumulation.add

    def add_and_quantise(piece, *args, **kwargs):
        add(piece, *args, **kwargs)
        buffer = accumulation._buffers[id(piece.param)][1]
        buffer.copy_(quantise_nearest(buffer))

    accumulation.add = add_and_quantise
    train_accumulating(ours, opt, steps=1)
    train_accumulating(ref, emulated, steps=1)
    assert max_rel_diff(ours, ref) <= FP32_BOUND
    assert_clips_the_quantised_sum(ours, opt, 0.3)


def assert_clips_the_quantised_sum(model, opt, max_norm: float) -> None:
    """After one step: the step's norm is that of the quantised sum, and AdaLomo's moments
    (beta2 = 0 at step 1: u = (coef * g)^2 + eps0 averaged over each row and column, or u
    itself) are those of that sum clipped by it. The update, normalised by its RMS, hides a
    sum scaled alike everywhere; the moments do not. From torch's .grad quantised after every
    micro-batch, in float64; the moments' fp32 sums of n squares are within n + 8 units of
    2^-24 (relative) of it."""
    start = tiny_llama()
    for micro in micro_batches(0):
        (start(**micro).loss / K).backward()
        for p in start.parameters():
            p.grad = quantise_nearest(p.grad)
    grads = [p.grad.double() for p in start.parameters()]
    norm = math.sqrt(sum(float((g * g).sum()) for g in grads))
    assert abs(float(opt.last_grad_norm) / norm - 1) <= FP32_BOUND
    assert norm > max_norm  # the clip binds
    coef = min(1.0, max_norm / (norm + 1e-6))
    for p, g in zip(model.parameters(), grads, strict=True):
        u = (coef * g) ** 2 + 1e-30
        state = opt.state[p]
        expected = {"exp_avg_sq": (u, 1)} if g.dim() == 1 else {
            "exp_avg_sq_row": (u.mean(dim=1), g.shape[1]),
            "exp_avg_sq_col": (u.mean(dim=0), g.shape[0]),
        }  # fmt: skip
        assert set(state) == set(expected)
        for name, (want, n) in expected.items():
            relative = (state[name].double() - want).abs() / want
            assert relative.max() <= (n + 8) * 2.0**-24, name


def test_stochastic_buffer_follows_the_fp32_buffer():
    # After one step the stochastically rounded 8-bit buffer's update differs from the fp32
    # buffer's by at most one scale step per micro-batch per element (each rounding moves a
    # value by less than its block's step), lr times that. (That it keeps the sum in
    # expectation: test_accumulation.py's test_bf16_buffer_keeps_additions_below_half_an_ulp.)
    ours, ref = tiny_llama(), tiny_llama()
    opt = Lomo(ours, lr=0.05, accumulation_steps=K, accumulation_dtype=torch.int8)
    full = Lomo(ref, lr=0.05, accumulation_steps=K, accumulation_dtype=torch.float32)
    train_accumulating(ours, opt, steps=1)
    train_accumulating(ref, full, steps=1)
    steps = {id(p): b.scales.max().item() for p, b, _ in opt._accumulation._buffers.values()}
    for (name, a), b in zip(ours.named_parameters(), ref.parameters(), strict=True):
        bound = 0.05 * K * steps[id(a)] * 2  # a step may double between micro-batches
        assert (a - b).abs().max().item() <= bound, name
    assert not torch.equal(next(ours.parameters()), next(tiny_llama().parameters()))


def test_no_change_before_the_last_micro_batch_and_one_byte_per_element():
    model = tiny_llama(torch.bfloat16)
    opt = Lomo(model, lr=0.05, clip_grad_norm=1.0, accumulation_steps=K,
               accumulation_dtype=torch.int8)  # fmt: skip
    start = snapshot(model)
    micros = micro_batches(0)
    for micro in micros[:-1]:
        opt.fused_backward(model(**micro).loss / K)
        assert unchanged(model, start) and all(p.grad is None for p in model.parameters())
    expected = sum(p.numel() + 4 * -(-p.numel() // BLOCK) for p in model.parameters())
    assert opt._accumulation.buffer_bytes() == expected
    opt.fused_backward(model(**micros[-1]).loss / K)
    assert not unchanged(model, start) and opt.step_count == 1


def test_fp16_overflow_in_one_micro_batch_skips_the_whole_step():
    model = tiny_llama(torch.float16)
    opt = Lomo(model, lr=0.05, clip_grad_norm=1.0, accumulation_steps=K,
               accumulation_dtype=torch.int8)  # fmt: skip
    scale = opt.loss_scaler.loss_scale
    before = tensors(model, opt)
    for i, micro in enumerate(micro_batches(0)):
        loss = model(**micro).loss / K
        opt.fused_backward(loss * float("inf") if i == 1 else loss)
    assert same_bits(before[: len(list(model.parameters()))], snapshot(model))
    assert opt.loss_scaler.loss_scale == scale / 2 and opt.step_count == 1
    assert opt.pending_micro_batches == 0
    opt.flush_report()
    assert opt.last_step_skipped
    # The next step trains from clean buffers: finite, as a fresh optimizer's buffers would.
    start = snapshot(model)
    for micro in micro_batches(0):
        opt.fused_backward(model(**micro).loss / K)
    opt.flush_report()
    assert not opt.last_step_skipped and not unchanged(model, start)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_short_step_measures_every_buffer():
    # opt.step() after 2 of 4 micro-batches: no micro-batch measured, so every buffer is
    # measured whole before the step (int8_buffer.measure_sumsq); the norm is that of the
    # quantised sum, as torch's clip sees it.
    ours, ref = tiny_llama(), tiny_llama()
    opt = Lomo(ours, lr=0.05, clip_grad_norm=0.5, accumulation_steps=K,
               accumulation_dtype=torch.int8, stochastic_rounding=False)  # fmt: skip
    for micro in micro_batches(0)[:2]:
        opt.fused_backward(ours(**micro).loss / 2)
    opt.step()
    (norm,) = train_torch_quantised(ref, 0.05, 0.5, steps=1, k=2)
    assert max_rel_diff(ours, ref) <= FP32_BOUND
    # The clip binds, so the parameters alone would not see a sum scaled by any factor.
    assert norm > 0.5 and abs(float(opt.last_grad_norm) / float(norm) - 1) <= FP32_BOUND


@pytest.mark.parametrize("offset", [512, 300])
def test_slices_store_the_whole_buffer(backend, offset):
    # A rank's slice has its own buffer whose blocks are the parameter's, cut at its edges:
    # at a block edge (512) the two slices store exactly the whole buffer's codes and scales
    # (the rounding bits follow the flat index); at 300 only the block the edge cuts differs
    # (two scales instead of one), by less than one step of that block.
    from lomo_kernels.distributed import Shard
    from lomo_kernels.ops.backends import LOMO
    from lomo_kernels.optim.accumulation import Accumulation
    from lomo_kernels.optim.int8_buffer import dequantized
    from lomo_kernels.optim.rounding import WriteBackRounding

    n = 1000
    gen = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.zeros(n))
    grads = [torch.randn(n, generator=gen) for _ in range(3)]
    module = LOMO.resolve(torch.device("cpu"), backend)
    values = []
    for cuts in ((0, n), (0, offset, n)):
        parts = []
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):  # one Accumulation per rank
            accumulation = Accumulation(3, torch.int8, WriteBackRounding(True, seed=11))
            accumulation.begin_micro_batch(5, [torch.device("cpu")], measuring=False)
            shard = Shard(param, param.detach()[a:b], a, param.shape, None)
            for grad in grads:
                piece = piece_of(param, grad[a:b], target=shard.local, offset=a, shard=shard)
                accumulation.add(piece, 7, None, module)
            ((_, buffer, _),) = accumulation.buffered()
            assert buffer.offset == a
            parts.append(dequantized(buffer, torch.float32, module))
        values.append(torch.cat(parts))
    whole, sliced = values
    cut = slice(offset // BLOCK * BLOCK, (offset // BLOCK + 1) * BLOCK)
    outside = torch.ones(n, dtype=torch.bool)
    if offset % BLOCK:
        outside[cut] = False
        step = whole[cut].abs().max() / 64  # the cut block's step is at most max / 64
        assert (whole[cut] - sliced[cut]).abs().max() <= 2 * step
    assert torch.equal(whole[outside], sliced[outside])


@pytest.mark.parametrize("rows_per_block", [16, 5])
def test_row_blocks_store_the_whole_buffer_and_measure_it_once(backend, rows_per_block):
    # A head's vocabulary chunks add their rows into the weight's one buffer. With 16 rows of
    # 32 (512 elements) the chunks cover whole blocks: the buffer equals the whole gradient's
    # add bit for bit and each chunk measures its rows. With 5 rows (160 elements) the chunks
    # cut blocks: those are re-rounded whole, and the buffer is measured once, whole, at the
    # step (no block counted twice).
    from lomo_kernels.ops.backends import LOMO
    from lomo_kernels.optim.accumulation import Accumulation
    from lomo_kernels.optim.device_scalars import DeviceScalars
    from lomo_kernels.optim.int8_buffer import dequantized
    from lomo_kernels.optim.rounding import WriteBackRounding

    rows, width = 96, 32
    gen = torch.Generator().manual_seed(1)
    param = torch.nn.Parameter(torch.zeros(rows, width))
    grads = [torch.randn(rows, width, generator=gen) for _ in range(2)]
    module = LOMO.resolve(torch.device("cpu"), backend)
    results = []
    for blocked in (False, True):
        accumulation = Accumulation(2, torch.int8, WriteBackRounding(False, seed=0))
        scalars = DeviceScalars(torch.device("cpu"))
        for i, grad in enumerate(grads):
            accumulation.begin_micro_batch(0, [torch.device("cpu")], measuring=i == 1)
            if blocked:
                for start in range(0, rows, rows_per_block):
                    stop = min(rows, start + rows_per_block)
                    piece = piece_of(param, grad[start:stop], scalars, target=param[start:stop],
                                     offset=start * width)  # fmt: skip
                    accumulation.add(piece, 3, None, module)
            else:
                accumulation.add(piece_of(param, grad, scalars), 3, None, module)
        by_device = {scalars.device: scalars}
        accumulation.measure_rest(by_device.__getitem__, lambda p: 3, lambda d: None, module)
        ((_, buffer, _),) = accumulation.buffered()
        values = dequantized(buffer, torch.float32, module)
        sumsq = scalars.sumsq.item()
        results.append((values, sumsq))
    (whole, whole_sumsq), (blocked_values, blocked_sumsq) = results
    measured = blocked_values.double().pow(2).sum().item()
    assert math.isclose(blocked_sumsq, measured, rel_tol=1e-5)  # once, not twice
    if rows_per_block * width % BLOCK == 0:
        assert torch.equal(whole, blocked_values) and math.isclose(whole_sumsq, blocked_sumsq,
                                                                   rel_tol=1e-6)  # fmt: skip
    else:
        total = sum(grads)
        assert (blocked_values - total).abs().max() <= total.abs().max() / 64 * 3


def values_of(buffer) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole parameter's 8-bit buffer read in float64: (values, each element's step: its
    block's scale), flat."""
    steps = buffer.scales.double().repeat_interleave(BLOCK)[: buffer.codes.numel()]
    return buffer.codes.double().reshape(-1) * steps, steps


def test_logits_free_head_with_the_8_bit_buffer(monkeypatch):
    # The patched head hands its weight's gradient over in chunks of 64 rows of 32 (2048
    # elements: whole blocks); the run trains, no full head gradient exists, and it follows
    # the unpatched model with the same buffer to within one code step per write. Each step
    # starts both from the same weights; the two fp32 losses differ in their last bits, and
    # so do the gradients: within 64 u of the tensor's largest (test_causal_lm_patch's
    # bound), that largest at most the stored values' largest before and after the write
    # plus a step. A write rounds to nearest on its block's grid: when the two sums it rounds
    # differ by d, the stored values differ by at most d plus one step (the larger of the
    # two blocks' scales). So after micro-batch k the buffers differ per element by at most
    # the sum of the steps of its k writes plus the gradients' differences. A block's
    # gradient 20% off moves its values by far more than those K steps (each at most 1 / 127
    # of the block's largest value).
    from lomo_kernels import patch_causal_lm
    from lomo_kernels.ops import cross_entropy as lce

    monkeypatch.setattr(lce, "CHUNK_ELEMENTS", 64 * 32)
    patched, plain = patch_causal_lm(tiny_llama()), tiny_llama()
    materialised: list[int] = []
    original = lce._backward_op
    monkeypatch.setattr(lce, "_backward_op", lambda *a: (materialised.append(1), original(*a))[1])
    lr, clip = 0.05, 0.5
    options = dict(lr=lr, clip_grad_norm=clip, accumulation_steps=K,
                   accumulation_dtype=torch.int8, stochastic_rounding=False)  # fmt: skip
    ours, ref = Lomo(patched, **options), Lomo(plain, **options)
    pairs = list(zip(patched.parameters(), plain.parameters(), strict=True))
    names = [name for name, _ in plain.named_parameters()]
    for step in range(2):
        with torch.no_grad():
            for a, b in pairs:
                b.copy_(a)
        start = [a.detach().double().reshape(-1) for a, _ in pairs]
        steps = [torch.zeros_like(s) for s in start]  # per element: its writes' steps
        drift = [0.0] * len(pairs)  # per tensor: the gradients' differences so far
        before = [0.0] * len(pairs)  # per tensor: the plain buffer's largest value
        for micro in micro_batches(step):
            ours.fused_backward(patched(**micro).loss / K)
            ref.fused_backward(plain(**micro).loss / K)
            # The buffers are kept past the step that reads them (`Accumulation._buffers`).
            held = [{id(p): values_of(b) for p, b, _ in o._accumulation._buffers.values()}
                    for o in (ours, ref)]  # fmt: skip
            allowed = []
            for i, (a, b) in enumerate(pairs):
                (va, sa), (vb, sb) = held[0][id(a)], held[1][id(b)]
                step_now = torch.maximum(sa, sb)
                steps[i] += step_now
                largest = vb.abs().max().item()
                drift[i] += 64 * 2**-24 * (largest + before[i] + step_now.max().item())
                before[i] = largest
                allowed.append(steps[i] + drift[i])
                assert ((va - vb).abs() <= allowed[i]).all(), names[i]
        # The step: lr * coef * buffer, the coefficient min(1, clip / (norm + 1e-6)) of each
        # buffer's norm (the package's in fp32: within 2**-20 of the float64 value here), so
        # the weights differ by lr * (coef * allowed + |coef_a - coef_b| * |buffer|), plus
        # each side's fp32 roundings: the coefficient's, the update's products (at most 3 *
        # 2**-24 of it) and the subtraction (2**-24 of |p| + |update|).
        norms = [torch.cat([h[id(p)][0] for p in model.parameters()]).norm().item()
                 for h, model in zip(held, (patched, plain), strict=True)]  # fmt: skip
        coef_a, coef_b = (min(1.0, clip / (norm + 1e-6)) for norm in norms)
        assert coef_a < 1  # clipped
        for i, (a, b) in enumerate(pairs):
            vb = held[1][id(b)][0]
            update = lr * max(coef_a, coef_b) * (vb.abs() + allowed[i])
            bound = lr * (max(coef_a, coef_b) * allowed[i] + abs(coef_a - coef_b) * vb.abs())
            bound += (2 * 2**-20 + 6 * 2**-24) * update + 2**-23 * (start[i].abs() + update)
            diff = (a.detach().double() - b.detach().double()).abs().reshape(-1)
            assert (diff <= bound).all(), names[i]
    assert not materialised and ours.step_count == 2


@pytest.mark.parametrize("optimizer", [Lomo, AdaLomo])
def test_no_host_sync_with_the_8_bit_buffer(optimizer):
    from support.host_sync import train_without_host_sync

    lr = 0.05 if optimizer is Lomo else 1e-3
    _, opt = train_without_host_sync(optimizer, torch.bfloat16, steps=8, lr=lr,
                                     clip_grad_norm=1.0, accumulation_steps=4,
                                     accumulation_dtype=torch.int8)  # fmt: skip
    assert opt.step_count == 2


SEEDS = 600
# The Triton interpreter takes tens of milliseconds a call: 600 seeds would take minutes.
# Every backend draws the same bits from the same seed and flat index (tests/ops), so on
# Triton each case's buffers are checked equal to the C++ backend's bit for bit on a few
# seeds, and the C++ and torch backends carry the statistics.
SEEDS_AGAINST_CPP = 6


def buffer_bits(buffer) -> list[torch.Tensor]:
    """The tensors a buffer stores (an 8-bit buffer's codes and scales)."""
    from lomo_kernels.optim.int8_buffer import Int8Buffer

    return [buffer.codes, buffer.scales] if isinstance(buffer, Int8Buffer) else [buffer]


def assert_mean_over_seeds_is_exact(backend, rounded, exact, step) -> None:
    """`rounded(backend, seed)`: the buffer one seed leaves. Its values' mean over SEEDS seeds
    is `exact` within 6 standard errors of a rounding onto a grid of step `step` (variance at
    most step**2 / 4 per rounding, two roundings per value); on Triton, the C++ backend's
    buffers bit for bit (SEEDS_AGAINST_CPP above)."""
    from lomo_kernels.ops.backends import LOMO
    from lomo_kernels.optim.int8_buffer import Int8Buffer, dequantized

    if backend == "triton":
        for seed in range(SEEDS_AGAINST_CPP):
            ours, cpp = buffer_bits(rounded("triton", seed)), buffer_bits(rounded("cpp", seed))
            assert same_bits(ours, cpp), f"seed {seed}: other bits than the C++ backend's"
        return
    module = LOMO.resolve(torch.device("cpu"), backend)
    total = torch.zeros(exact.shape, dtype=torch.float64)
    for seed in range(SEEDS):
        buffer = rounded(backend, seed)
        if isinstance(buffer, Int8Buffer):
            buffer = dequantized(buffer, torch.float32, module)
        total += buffer.double().reshape(exact.shape)
    bound = 6 * (2 * step**2 / 4 / SEEDS) ** 0.5
    assert (total / SEEDS - exact).abs().max() <= bound


@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16])
def test_a_gradient_in_parts_is_rounded_without_bias(backend, dtype):
    # One micro-batch whose gradient arrives in two parts (two uses of the weight in
    # reentrant checkpoint segments, say): the second part grows the values' scale (the
    # 8-bit block's, from 1 to 2; bf16's binade), so each value is rounded again. With the
    # first part's bits the second rounding would follow the first's direction (1.5 and
    # 0.7 land on 1.0 on average); with fresh bits each value's mean over seeds is its exact
    # sum.
    from lomo_kernels.ops.backends import LOMO
    from lomo_kernels.optim.accumulation import Accumulation
    from lomo_kernels.optim.rounding import WriteBackRounding

    param = torch.nn.Parameter(torch.zeros(256))
    first, second = torch.zeros(256), torch.zeros(256)
    first[0], first[1:50], first[50:100], first[100:150] = 100.0, 1.5, 0.7, -1.3
    second[0] = 150.0  # the block's largest value 100 -> 250: its step doubles
    if dtype == torch.bfloat16:  # values in [4, 8), moved to [8, 16) (bf16 step 1/32 -> 1/16)
        first, second = first / 32 + 4, torch.full((256,), 4.0)

    def rounded(backend: str, seed: int):
        module = LOMO.resolve(torch.device("cpu"), backend)
        accumulation = Accumulation(2, dtype, WriteBackRounding(True, seed=seed))
        accumulation.begin_micro_batch(0, [torch.device("cpu")], measuring=False)
        for part in (first, second):
            accumulation.add(piece_of(param, part.clone()), 0, None, module)
        ((_, buffer, _),) = accumulation.buffered()
        return buffer

    # The larger grid step met: the block's power-of-two scale once 250 is in it (2), bf16's
    # in [8, 16).
    step = 2.0 if dtype == torch.int8 else 1 / 16
    assert_mean_over_seeds_is_exact(backend, rounded, (first + second).double(), step)


def test_a_row_block_re_rounding_a_cut_block_draws_new_bits(backend):
    # A head's chunks of 5 rows of 32 (160 elements) cut the 8-bit blocks of 256: the second
    # chunk re-rounds block 0, whose first 160 values the first chunk rounded, and its value
    # 250 doubles the block's step (1 -> 2). Drawn with the first chunk's bits again, the
    # second rounding would follow the first's direction (1.5 and 0.7 biased); with fresh
    # bits each value's mean over seeds is its exact value.
    from lomo_kernels.ops.backends import LOMO
    from lomo_kernels.optim.accumulation import Accumulation
    from lomo_kernels.optim.rounding import WriteBackRounding

    rows, width, per_chunk = 16, 32, 5
    param = torch.nn.Parameter(torch.zeros(rows, width))
    grad = torch.zeros(rows * width)
    grad[0], grad[1:50], grad[50:100], grad[100:160] = 100.0, 1.5, 0.7, -1.3
    grad[160] = 250.0
    grad = grad.view(rows, width)

    def rounded(backend: str, seed: int):
        module = LOMO.resolve(torch.device("cpu"), backend)
        accumulation = Accumulation(2, torch.int8, WriteBackRounding(True, seed=seed))
        accumulation.begin_micro_batch(0, [torch.device("cpu")], measuring=False)
        for start in range(0, rows, per_chunk):
            stop = min(rows, start + per_chunk)
            piece = piece_of(param, grad[start:stop], target=param[start:stop],
                             offset=start * width)  # fmt: skip
            accumulation.add(piece, 0, None, module)
        ((_, buffer, _),) = accumulation.buffered()
        return buffer

    assert_mean_over_seeds_is_exact(backend, rounded, grad.double(), 2.0)


def int8_buffer_holding(values: torch.Tensor, offset: int):
    """An 8-bit buffer at flat `offset` of its parameter holding `values` (fp32, stored to
    nearest by the torch backend's accumulate, `first=True`)."""
    from lomo_kernels import ops
    from lomo_kernels.optim.int8_buffer import Int8Buffer

    buffer = Int8Buffer.like(values, offset, zeroed=True)
    ops.grad_accumulate_int8_(buffer.codes, buffer.scales, values, offset=offset, first=True,
                              stochastic_rounding=False, backend="torch")  # fmt: skip
    return buffer


@pytest.mark.parametrize(("start", "stop"), [(0, 700), (212, 500), (211, 213), (469, 700)])
def test_a_part_of_an_unaligned_buffer_is_its_own_elements_and_blocks(start, stop):
    # A buffer at offset 300 (its first block starts at element -44 of it): a part holds its
    # elements' codes and the scales of exactly the blocks they touch, at its own offset, and
    # reads back the whole buffer's values there; block_bounds widens to those blocks' edges.
    from lomo_kernels.optim import int8_buffer

    values = torch.randn(700, generator=torch.Generator().manual_seed(5)) * torch.logspace(
        -3, 3, 700
    )
    buffer = int8_buffer_holding(values, offset=300)
    whole = int8_buffer.dequantized(buffer, torch.float32, "torch")
    part = buffer.part(start, stop)
    assert part.offset == 300 + start and part.numel() == stop - start
    first, last = (300 + start) // BLOCK, (300 + stop - 1) // BLOCK  # the parameter's blocks
    assert torch.equal(part.scales, buffer.scales[first - 300 // BLOCK : last - 300 // BLOCK + 1])
    assert torch.equal(int8_buffer.dequantized(part, torch.float32, "torch"), whole[start:stop])
    low, high = buffer.block_bounds(start, stop)
    assert (low, high) == (max(0, first * BLOCK - 300), min(700, (last + 1) * BLOCK - 300))


def test_an_fp16_parameter_reads_its_8_bit_buffer_in_fp32():
    # The buffer's scales reach past fp16's range (sums of fp16 gradients over micro-batches,
    # loss-scaled): an fp16 parameter's update (AdaLomo's) reads the values in fp32, not inf.
    from lomo_kernels.optim import int8_buffer

    values = torch.tensor([1e5, -7e4, 3.0, 0.0])
    read = int8_buffer.dequantized(int8_buffer_holding(values, 0), torch.float16, "torch")
    assert read.dtype == torch.float32 and torch.isfinite(read).all()
    assert read.tolist() == quantise_nearest(values).tolist()


def test_the_whole_buffer_measure_is_scaled_and_chunked(monkeypatch):
    # The step's measurement of a buffer no micro-batch measured: the sum of squares of its
    # values times the inverse loss scale, whatever the chunk it is dequantised in (here 100
    # elements, a buffer of 700 at offset 300: parts cut at unaligned blocks), against float64.
    from lomo_kernels.optim import int8_buffer

    values = torch.randn(700, generator=torch.Generator().manual_seed(6)) * 1e3
    buffer = int8_buffer_holding(values, offset=300)
    stored = int8_buffer.dequantized(buffer, torch.float32, "torch").double()
    inv = torch.tensor([2.0**-10])
    want = (stored * 2.0**-10).pow(2).sum().item()
    for chunk in (int8_buffer.MEASURE_CHUNK, 100):
        monkeypatch.setattr(int8_buffer, "MEASURE_CHUNK", chunk)
        sumsq, found = torch.zeros(1), torch.zeros(1)
        int8_buffer.measure_sumsq(buffer, sumsq, found, inv, "torch")
        # Each chunk's float64 sum is rounded once into the fp32 total: at most 8 roundings.
        assert sumsq.item() == pytest.approx(want, rel=8 * 2**-24) and found.item() == 0
