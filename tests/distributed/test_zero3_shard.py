"""This rank's part of a ZeRO-3 parameter (`distributed/zero3.py: zero3_shard`) at every rank
of a partition whose last ranks hold padding: DeepSpeed gives each rank ``ceil(numel / W)``
elements of ``ds_tensor``, the tail past ``numel`` zero padding. The optimizer updates and
measures `local`, so it must be the owned elements alone, a view of ``ds_tensor``'s storage
at the flat offset the rank's elements start at (the 2-rank runs, test_zero3.py, pad only
where the world divides unevenly and compare with one process, which padding cannot show)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lomo_kernels.distributed import zero3


def _zero3_param(numel: int, world: int, shape: tuple[int, ...]):
    """A stand-in for a ZeRO-3 parameter: the attributes zero3_shard reads."""
    size = -(-numel // world)
    ds_tensor = torch.arange(size, dtype=torch.float32)
    ds_tensor.ds_numel = size  # DeepSpeed's partition size, padding included
    return SimpleNamespace(
        ds_tensor=ds_tensor, ds_numel=numel, ds_shape=shape, ds_process_group="group"
    )


# (numel, world): a last rank with 2 elements of padding, ranks holding nothing but padding
# (5 over 4: 2 + 2 + 1 + 0), and an even split.
CASES = [(10, 4, (2, 5)), (5, 4, (5,)), (12, 4, (3, 4))]


@pytest.mark.parametrize("numel,world,shape", CASES, ids=[f"{n}over{w}" for n, w, _ in CASES])
def test_each_rank_s_local_view_is_its_owned_elements(monkeypatch, numel, world, shape):
    size = -(-numel // world)
    owned_total = 0
    for rank in range(world):
        monkeypatch.setattr(zero3.dist, "get_rank", lambda group, rank=rank: rank)
        param = _zero3_param(numel, world, shape)
        shard = zero3.zero3_shard(param)
        start = min(rank * size, numel)
        owned = max(0, min(size, numel - rank * size))
        assert shard.offset == start
        assert shard.local.numel() == owned
        assert shard.full_shape == torch.Size(shape) and shard.group == "group"
        if owned:  # a view of the partition's first elements, not a copy
            assert shard.local.data_ptr() == param.ds_tensor.data_ptr()
            shard.local.fill_(-1.0)
            assert (param.ds_tensor[:owned] == -1.0).all()
            assert torch.equal(param.ds_tensor[owned:], torch.arange(owned, size).float())
        owned_total += owned
    assert owned_total == numel  # the ranks' views tile the parameter, padding left out
