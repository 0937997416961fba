"""AdaLomo on parameter slices (the sharded path) against the float64 model, in one process.

One "rank" owning the whole parameter (the all-reduce is the identity) exercises the slice
code's blocking: parameters larger than CHUNK are walked in several blocks, a matrix with
rows wider than a block included. The 2-rank equality with one process is in
test_zero3.py / test_fsdp2.py.
"""

from __future__ import annotations

import threading

import pytest
import torch
from support.adalomo import adalomo_f64, beta2_at, check_param, check_state, make_param

from lomo_kernels.distributed.shard import Shard
from lomo_kernels.ops import adalomo_update_
from lomo_kernels.ops.adalomo import adalomo_step_arguments
from lomo_kernels.ops.adalomo.reference import CHUNK
from lomo_kernels.optim.adalomo_slices import SliceStep, adalomo_slices_, init_slice_state

SHAPES = [(CHUNK // 100 + 7, 300), (3, CHUNK + 5), (2 * CHUNK + 3,)]


def slice_arguments(
    *,
    lr: float,
    beta2: float,
    weight_decay: float = 0.0,
    clip_threshold: float = 1.0,
    stochastic_rounding: bool = False,
    seed: int = 0,
    seed_step=None,
) -> dict:
    """The passes' step-wide arguments of a slice step, converted as an optimizer's."""
    return adalomo_step_arguments(
        torch.device("cpu"), True, lr=lr, beta2=beta2, eps=(1e-30, 1e-3),
        clip_threshold=clip_threshold, weight_decay=weight_decay, inv_scale=None,
        clip_value=None, clip_coef=None, found_inf=None, skip_if=None,
        stochastic_rounding=stochastic_rounding, seed=seed, seed_step=seed_step,
    )  # fmt: skip


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_whole_parameter_slice_equals_float64_model(shape, dtype):
    param = make_param(shape, dtype, seed=1)
    grad = make_param(shape, dtype, seed=2)
    before = param.clone()
    shard = Shard(param=param, local=param.view(-1), offset=0, full_shape=param.shape, group=None)
    state = init_slice_state(shard)
    kwargs = {"lr": 0.01, "beta2": beta2_at(2), "weight_decay": 0.1, "clip_threshold": 0.8}
    ref, ref_state, delta = adalomo_f64(param, grad, state, **kwargs)
    step = SliceStep(
        shard=shard, grad=grad.view(-1), state=state, arguments=slice_arguments(**kwargs)
    )
    found = torch.zeros(1)
    adalomo_slices_([step], torch.zeros(1), found, lambda t: None)
    assert found.item() == 0.0
    check_param(param, ref, before, delta, dtype)
    check_state(state, ref_state)


def _bucket(grad_inf_at: int | None = None) -> tuple[list[SliceStep], list[torch.Tensor]]:
    """Three whole-parameter slices in one bucket (two matrices, one vector): the second
    matrix's gradient non-finite where asked."""
    steps, params = [], []
    for i, shape in enumerate([(37, 300), (5, 1031), (4099,)]):
        param, grad = (
            make_param(shape, torch.bfloat16, seed=i),
            make_param(shape, torch.bfloat16, seed=9 + i),
        )
        if i == 1 and grad_inf_at is not None:
            grad.view(-1)[grad_inf_at] = float("inf")
        shard = Shard(param=param, local=param.view(-1), offset=0, full_shape=param.shape,
                      group=None)  # fmt: skip
        arguments = slice_arguments(lr=0.01, beta2=0.5)
        steps.append(SliceStep(shard=shard, grad=grad.view(-1), state=init_slice_state(shard),
                               arguments=arguments))  # fmt: skip
        params.append(param)
    return steps, params


def test_a_bucket_skips_each_parameter_on_its_own_flags():
    """In one bucket, a parameter with its own skip flag and one with a non-finite gradient
    element keep their values and moments (the latter raises found_inf); the third steps
    bit for bit as in a bucket of its own. The bucket's skip_if skips all, raising nothing."""
    alone, alone_params = _bucket()
    adalomo_slices_(alone[2:], torch.zeros(1), torch.zeros(1), lambda t: None)
    steps, params = _bucket(grad_inf_at=777)
    before = [p.clone() for p in params]
    moments = [{k: v.clone() for k, v in s.state.items()} for s in steps]
    steps[0].skip = torch.ones(1)
    found = torch.zeros(1)
    adalomo_slices_(steps, torch.zeros(1), found, lambda t: None)
    assert found.item() == 1.0
    for i in (0, 1):
        assert torch.equal(params[i], before[i]), i
        assert all(torch.equal(steps[i].state[k], v) for k, v in moments[i].items()), i
    assert torch.equal(params[2], alone_params[2]) and not torch.equal(params[2], before[2])
    assert torch.equal(steps[2].state["exp_avg_sq"], alone[2].state["exp_avg_sq"])

    steps, params = _bucket(grad_inf_at=777)
    before, found = [p.clone() for p in params], torch.zeros(1)
    adalomo_slices_(steps, torch.ones(1), found, lambda t: None)
    assert found.item() == 0.0
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))


# Longest a thread "rank" waits for the other at the all-reduce (a step here takes
# milliseconds): past it, the wait fails instead of hanging the run.
BARRIER_TIMEOUT_S = 60


def run_two_ranks(work) -> None:
    """Runs ``work(rank, all_reduce_sum_)`` for ranks 0 and 1 in two threads, the all-reduce
    summing their tensors in place. An exception in either rank breaks the barrier (the
    other's wait fails at once rather than hanging) and is raised here; a rank still waiting
    after BARRIER_TIMEOUT_S fails too."""
    barrier, parts, errors = threading.Barrier(2, timeout=BARRIER_TIMEOUT_S), [None, None], []

    def rank(r: int) -> None:
        def all_reduce_sum_(t: torch.Tensor) -> None:
            parts[r] = t.clone()
            barrier.wait()
            total = parts[0] + parts[1]
            barrier.wait()
            t.copy_(total)

        try:
            work(r, all_reduce_sum_)
        except BaseException as error:
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=2 * BARRIER_TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "a rank thread did not finish"
    # The first error that is not the other rank's broken barrier.
    for error in sorted(errors, key=lambda e: isinstance(e, threading.BrokenBarrierError)):
        raise error


def run_sliced(param, grad, dtype, stochastic: bool, seed, step_value) -> torch.Tensor:
    """One AdaLomo step of `param` as two "ranks" each owning a flat slice cut mid-row;
    returns the stepped flat tensor."""
    sliced = param.clone().view(-1)
    cut = param.numel() // 2 + 3
    bounds = [(0, cut), (cut, param.numel())]

    def work(r: int, all_reduce_sum_) -> None:
        a, b = bounds[r]
        shard = Shard(param=param, local=sliced[a:b], offset=a, full_shape=param.shape, group=None)
        arguments = slice_arguments(
            lr=1e-4, beta2=0.5, stochastic_rounding=stochastic and dtype != torch.float32,
            seed=seed, seed_step=step_value,
        )  # fmt: skip
        step = SliceStep(
            shard=shard, grad=grad.view(-1)[a:b].float(), state=init_slice_state(shard),
            arguments=arguments,
        )  # fmt: skip
        adalomo_slices_([step], torch.zeros(1), torch.zeros(1), all_reduce_sum_)

    run_two_ranks(work)
    return sliced


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", [(37, 1031), (4099,)], ids=["37x1031", "4099"])
def test_two_ranks_round_stochastically_as_the_whole_tensor(shape, dtype):
    """Two "ranks" (threads with a summing all-reduce) each own a flat slice cut mid-row:
    with stochastic rounding every element draws the bits of its index in the whole tensor,
    so the slices together equal one process's whole-tensor step wherever the two fp32
    results agree (the same step on fp32 weights); where those differ (partial sums added in
    another order), an element may land on the other neighbour: one spacing apart."""
    param, grad = make_param(shape, dtype, seed=3), make_param(shape, dtype, seed=4) * 0.01
    seed, step_value = 6, torch.tensor([99], dtype=torch.int64)
    whole, whole32 = param.clone(), param.float()
    for out, stochastic in ((whole, True), (whole32, False)):
        options = dict(stochastic_rounding=stochastic, seed=seed, seed_step=step_value)
        adalomo_update_(out, grad, {}, lr=1e-4, beta2=0.5, backend="torch", **options)
    sliced = run_sliced(param, grad, dtype, True, seed, step_value)
    sliced32 = run_sliced(param.float(), grad, torch.float32, False, seed, step_value)
    ours, ref = sliced.view(torch.int16).int(), whole.view(-1).view(torch.int16).int()
    differ = ours != ref
    fp32_agree = sliced32.view(torch.int32) == whole32.view(-1).view(torch.int32)
    assert not bool((differ & fp32_agree).any()), "other draws for one fp32 value"
    assert bool(((ours[differ] - ref[differ]).abs() == 1).all())
    assert (sliced != param.view(-1)).any()  # it stepped


def test_a_failing_rank_fails_the_run_without_hanging():
    """The thread ranks' harness: one rank's exception is raised, the other's wait at the
    all-reduce breaks instead of waiting forever."""

    def work(r: int, all_reduce_sum_) -> None:
        if r == 1:
            raise ZeroDivisionError("rank 1 failed")
        all_reduce_sum_(torch.ones(1))

    with pytest.raises(ZeroDivisionError, match="rank 1 failed"):
        run_two_ranks(work)
