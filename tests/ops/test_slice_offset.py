"""A slice of a parameter (a ZeRO-3 or FSDP2 shard, a block of rows) stepped or accumulated in
one call with its flat `offset`: stochastic rounding draws the bits of the parameter's flat
indices, so the slices together store exactly what one call on the whole tensor stores, on
every backend (torch reference, C++, Triton through its interpreter). Past 2**32 the bits
are checked against the float64 models of the accumulation's and the update's streams
(support/grad_accumulate). Bad offsets are refused before anything is
written. The CPU levels' slices (heads before a multiple of 32, the squares' lanes) are in
tests/kernels/test_cpu_dispatch.py."""

from __future__ import annotations

import pytest
import torch
from support.grad_accumulate import DTYPES, element_bits16, fp32_sum, make_case, sr_model

from lomo_kernels import ops
from lomo_kernels.ops.lomo import cpp_backend, reference

# A 4133-element parameter cut at awkward places: one element, pairs of the accumulation's
# stream (i, i ^ 16) split across a cut, a cut 5 past a multiple of 32, the rest.
WHOLE = 4133
CUTS = [0, 1, 18, 47, 2085, WHOLE]
SEED, STEP = 2**40 + 77, 12345


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _slices():
    return [(a, b) for a, b in zip(CUTS, CUTS[1:], strict=False)]


def _accumulate(backend, buffer, grad, first, offset=0):
    found = torch.zeros(1)
    ops.grad_accumulate_(buffer, grad, first=first, inv_scale=0.5, found_inf=found,
                         stochastic_rounding=True, seed=SEED, seed_step=torch.tensor([STEP]),
                         offset=offset, backend=backend)  # fmt: skip
    return found


def _update(backend, param, grad, offset=0):
    found = torch.zeros(1)
    stochastic = param.dtype != torch.float32  # fp32 stores the result unrounded
    ops.fused_lomo_update_(param, grad, lr=3e-2, inv_scale=0.5, clip_value=4.0, clip_coef=0.75,
                           weight_decay=0.1, found_inf=found, stochastic_rounding=stochastic,
                           seed=SEED, seed_step=torch.tensor([STEP]), offset=offset,
                           backend=backend)  # fmt: skip
    return found


@pytest.mark.parametrize("first", [False, True], ids=["add", "first"])
@pytest.mark.parametrize("bdt,gdt", [("bf16", "fp32"), ("bf16", "bf16"), ("fp16", "fp16")])
def test_slices_accumulate_as_the_whole_buffer(backend, bdt, gdt, first):
    buffer, grad = make_case(WHOLE, DTYPES[bdt], DTYPES[gdt], seed=3)
    whole = buffer.clone()
    _accumulate(backend, whole, grad, first)
    sliced = buffer.clone()
    for a, b in _slices():
        found = _accumulate(backend, sliced[a:b], grad[a:b], first, offset=a)
        assert found.item() == 0.0
    assert torch.equal(_bits(sliced), _bits(whole))
    if first and gdt == bdt:
        return  # the gradients stored as they are: nothing rounds
    # Not a property of equal bits everywhere: the slices' bits differ from a zero offset's.
    at_zero = buffer[CUTS[3] : CUTS[4]].clone()
    _accumulate(backend, at_zero, grad[CUTS[3] : CUTS[4]], first)
    assert not torch.equal(_bits(at_zero), _bits(whole[CUTS[3] : CUTS[4]]))


@pytest.mark.parametrize("pdt,gdt", [("bf16", "fp32"), ("bf16", "bf16"), ("fp16", "fp16")])
def test_slices_update_as_the_whole_parameter(backend, pdt, gdt):
    gen = torch.Generator().manual_seed(5)
    param = torch.randn(WHOLE, generator=gen).to(DTYPES[pdt])
    grad = (torch.randn(WHOLE, generator=gen) * 1e-2).to(DTYPES[gdt])
    whole = param.clone()
    _update(backend, whole, grad)
    sliced = param.clone()
    for a, b in _slices():
        assert _update(backend, sliced[a:b], grad[a:b], offset=a).item() == 0.0
    assert torch.equal(_bits(sliced), _bits(whole))
    at_zero = param[CUTS[3] : CUTS[4]].clone()
    _update(backend, at_zero, grad[CUTS[3] : CUTS[4]])
    assert not torch.equal(_bits(at_zero), _bits(whole[CUTS[3] : CUTS[4]]))


# Slices ending just past 2**32 (the index's high half changes inside), starting past it, and
# far past it; sizes with a head before a multiple of 32 and a tail.
FAR = [(2**32 - 45, 101), (2**32 + 5, 4099), (2**40 + 3, 70)]


@pytest.mark.parametrize("offset,n", FAR, ids=[f"o{o}-n{n}" for o, n in FAR])
@pytest.mark.parametrize("bdt", ["bf16", "fp16"])
def test_slices_past_2_32_accumulate_the_models_bits(backend, bdt, offset, n):
    buffer, grad = make_case(n, DTYPES[bdt], DTYPES[bdt], seed=n)
    x = fp32_sum(buffer, grad, False)
    assert _accumulate(backend, buffer, grad, False, offset=offset).item() == 0.0
    want = sr_model(x, DTYPES[bdt], SEED, STEP, offset).to(DTYPES[bdt])
    assert torch.equal(_bits(buffer), _bits(want))


@pytest.mark.parametrize("offset,n", FAR, ids=[f"o{o}-n{n}" for o, n in FAR])
@pytest.mark.parametrize("pdt", ["bf16", "fp16"])
def test_slices_past_2_32_update_with_the_models_bits(backend, pdt, offset, n):
    """The update's fp32 result (the same op on an fp32 copy, which stores it unrounded)
    rounded by the float64 model of the update's stream at flat indices offset + j."""
    gen = torch.Generator().manual_seed(n)
    param = torch.randn(n, generator=gen).to(DTYPES[pdt])
    grad = torch.randn(n, generator=gen) * 1e-2
    exact = param.float()
    _update(backend, exact, grad, offset=offset)
    got = param.clone()
    assert _update(backend, got, grad, offset=offset).item() == 0.0
    want = sr_model(exact.double(), DTYPES[pdt], SEED, STEP, offset, stream=element_bits16)
    assert torch.equal(_bits(got), _bits(want.to(DTYPES[pdt])))
    # The bits of offset + j: at offset 0 they differ.
    at_zero = param.clone()
    _update(backend, at_zero, grad)
    assert not torch.equal(_bits(at_zero), _bits(got))


@pytest.mark.parametrize("offset", [-1, 2**63, 2**63 - 3], ids=["negative", "2^63", "end"])
def test_bad_offsets_refused_before_any_change(backend, offset):
    param, grad = torch.randn(5).bfloat16(), torch.randn(5)
    before = param.clone()
    with pytest.raises(ValueError, match="offset"):
        _update(backend, param, grad, offset=offset)
    with pytest.raises(ValueError, match="offset"):
        _accumulate(backend, param, grad.bfloat16(), False, offset=offset)
    assert torch.equal(_bits(param), _bits(before))


def test_the_largest_fitting_offset_runs(backend):
    # Five elements ending at flat index 2**63 - 2 (the end, 2**63 - 1, an int64 too).
    param, grad = torch.randn(5).bfloat16(), torch.randn(5)
    got, want = param.clone(), param.clone()
    _update(backend, got, grad, offset=2**63 - 6)
    _update("torch", want, grad, offset=2**63 - 6)
    assert torch.equal(_bits(got), _bits(want))
    assert not torch.equal(_bits(got), _bits(param))


def test_the_binding_refuses_bad_offsets():
    # The extension checks its own arguments too (a caller may skip the public layer).
    if not cpp_backend.is_available("cpu"):
        pytest.skip(f"C++ backend unavailable: {cpp_backend.unavailable_reason('cpu')}")
    buffer, grad = torch.zeros(5, dtype=torch.bfloat16), torch.ones(5, dtype=torch.bfloat16)
    for offset in (-1, 2**63 - 3):
        with pytest.raises(RuntimeError, match="offset"):
            cpp_backend.grad_accumulate_(buffer, grad, False, None, None, None, True, 1, None,
                                         offset)  # fmt: skip
        with pytest.raises(RuntimeError, match="offset"):
            cpp_backend.lomo_update_(buffer, grad, torch.tensor([0.1]), None, None, None, 0.0,
                                     None, None, True, 1, None, offset)  # fmt: skip
    assert not buffer.any()


def test_offset_leaves_round_to_nearest_alone(backend):
    # Only the stochastic bits read the offset: to nearest, a slice stores the same anywhere.
    buffer, grad = make_case(300, torch.bfloat16, torch.float32, seed=8)
    at_zero, far = buffer.clone(), buffer.clone()
    for out, offset in ((at_zero, 0), (far, 2**32 + 7)):
        ops.grad_accumulate_(out, grad, offset=offset, backend=backend)
    assert torch.equal(_bits(at_zero), _bits(far))
    reference.grad_accumulate_(buffer, grad, False, None, None, None, False, 0, None, 0)
    assert torch.equal(_bits(buffer), _bits(at_zero))
