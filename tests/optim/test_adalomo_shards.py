"""AdaLomo on parameter slices (the sharded path) against the float64 model, in one process.

One "rank" owning the whole parameter (the all-reduce is the identity) exercises the slice
code's blocking: parameters larger than CHUNK are walked in several blocks, a matrix with
rows wider than a block included. The 2-rank equality with one process is in
test_zero3.py / test_fsdp2.py.
"""

from __future__ import annotations

import pytest
import torch
from support.adalomo import adalomo_f64, beta2_at, check_param, check_state, make_param

from lomo_kernels.distributed.shard import Shard
from lomo_kernels.ops.adalomo.reference import CHUNK, GradTransform
from lomo_kernels.optim.adalomo_slices import SliceStep, adalomo_slices_, init_slice_state

SHAPES = [(CHUNK // 100 + 7, 300), (3, CHUNK + 5), (2 * CHUNK + 3,)]


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
        shard=shard,
        grad=grad.view(-1),
        state=state,
        lr=torch.tensor([kwargs["lr"]]),
        beta2=kwargs["beta2"],
        eps=(1e-30, 1e-3),
        clip_threshold=kwargs["clip_threshold"],
        weight_decay=kwargs["weight_decay"],
        transform=GradTransform(None, None, None),
    )
    found = torch.zeros(1)
    adalomo_slices_([step], torch.zeros(1), found, lambda t: None)
    assert found.item() == 0.0
    check_param(param, ref, before, delta, dtype)
    check_state(state, ref_state)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", [(37, 1031), (4099,)], ids=["37x1031", "4099"])
def test_two_ranks_round_stochastically_as_the_whole_tensor(shape, dtype):
    """Two "ranks" (threads with a summing all-reduce) each own a flat slice cut mid-row:
    with stochastic rounding every element draws the bits of its index in the whole tensor,
    so the slices together equal one process's whole-tensor step, except where the two fp32
    results differ (partial sums added in another order) and a draw falls between them: such
    elements are one spacing apart, and few."""
    import threading

    from lomo_kernels.core.rounding import Rounding
    from lomo_kernels.ops import adalomo_update_

    param, grad = make_param(shape, dtype, seed=3), make_param(shape, dtype, seed=4) * 0.01
    seed, step_value = 6, torch.tensor([99], dtype=torch.int64)
    whole = param.clone()
    adalomo_update_(whole, grad, {}, lr=1e-4, beta2=0.5, backend="torch",
                    stochastic_rounding=True, seed=seed, seed_step=step_value)  # fmt: skip
    sliced = param.clone().view(-1)
    cut = param.numel() // 2 + 3
    bounds = [(0, cut), (cut, param.numel())]
    barrier, parts = threading.Barrier(2), [None, None]

    def rank(r: int) -> None:
        a, b = bounds[r]
        shard = Shard(param=param, local=sliced[a:b], offset=a, full_shape=param.shape, group=None)

        def all_reduce_sum_(t: torch.Tensor) -> None:
            parts[r] = t.clone()
            barrier.wait()
            total = parts[0] + parts[1]
            barrier.wait()
            t.copy_(total)

        step = SliceStep(
            shard=shard, grad=grad.view(-1)[a:b].float(), state=init_slice_state(shard),
            lr=torch.tensor([1e-4]), beta2=0.5, eps=(1e-30, 1e-3), clip_threshold=1.0,
            weight_decay=0.0, transform=GradTransform(None, None, None),
            rounding=Rounding(dtype, True, seed, step_value),
        )  # fmt: skip
        adalomo_slices_([step], torch.zeros(1), torch.zeros(1), all_reduce_sum_)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ours, ref = sliced.view(torch.int16).int(), whole.view(-1).view(torch.int16).int()
    differ = ours != ref
    assert int(differ.sum()) <= ours.numel() // 1000
    assert bool(((ours[differ] - ref[differ]).abs() == 1).all())
    assert (sliced != param.view(-1)).any()  # it stepped
