"""AdaLomo on parameter slices (the sharded path) against the float64 model, in one process.

One "rank" owning the whole parameter (the all-reduce is the identity) exercises the slice
code's blocking: parameters larger than CHUNK are walked in several blocks, a matrix with
rows wider than a block included. The 2-rank equality with one process is in
test_zero3.py / test_fsdp2.py.
"""

from __future__ import annotations

import pytest
import torch
from test_adalomo_ops import adalomo_f64, beta2_at, check_param, check_state, make_param

from lomo_kernels.distributed.shard import Shard
from lomo_kernels.ops.adalomo_reference import CHUNK, GradTransform
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
