"""The reduce-scatter buckets (`distributed/reduce_scatter.py`) in one process (a gloo group of
one rank, where the average over ranks is the gradient itself): gradients packed in arrival
order into buckets of at most `bucket_numel` elements, each bucket's slices handed over once
its collective completes, the oldest bucket first, by `add` beyond `max_inflight` buckets in
flight and by `finish()` for the rest. The ranks of a sharded run take the slices in this
order, so it is the order every rank updates in (the 2-rank runs are in test_zero3.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lomo_kernels.distributed.reduce_scatter import ReduceScatterBuckets
from lomo_kernels.distributed.shard import Shard


@pytest.fixture
def group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _shards(group, sizes: list[int]) -> list[tuple[Shard, torch.Tensor]]:
    """A parameter per size with its gradient (distinct values per parameter)."""
    out = []
    for k, n in enumerate(sizes):
        param = torch.nn.Parameter(torch.zeros(n))
        shard = Shard(param, param.detach().view(-1), 0, param.shape, group)
        out.append((shard, torch.arange(n, dtype=torch.float32) + 1000 * k))
    return out


@pytest.mark.parametrize("max_inflight", [1, 2, 3])
def test_buckets_are_handed_over_oldest_first(group, max_inflight):
    # Buckets of at most 10 elements: (4, 5), (6, 3) and (3, 3) launched as the next
    # gradient would overflow them, the 12-element gradient alone at once (before the open
    # (7)), and (7) by finish(): five collectives, handed over in the order they were
    # launched, each with its parameters in arrival order.
    sizes = [4, 5, 6, 3, 3, 3, 7, 12]
    reducer = ReduceScatterBuckets(bucket_numel=10, max_inflight=max_inflight)
    reducer.begin()
    handed: list[list[tuple[Shard, torch.Tensor]]] = []
    grads = {}
    for shard, grad in _shards(group, sizes):
        grads[id(shard)] = grad
        handed += reducer.add(shard, grad.clone(), grad.numel())
        assert reducer.collectives_launched - len(handed) <= max_inflight
    handed += list(reducer.finish())
    assert reducer.collectives_launched == 5
    assert [[s.param.numel() for s, _ in bucket] for bucket in handed] == [
        [4, 5], [6, 3], [3, 3], [12], [7]
    ]  # fmt: skip
    arrival = [id(s) for bucket in handed for s, _ in bucket]
    assert sorted(arrival, key=list(grads).index)[:6] == arrival[:6]
    for shard, reduced in (pair for bucket in handed for pair in bucket):
        assert torch.equal(reduced, grads[id(shard)])


def test_abandon_waits_for_every_collective_in_flight(group, monkeypatch):
    # After a failed backward nothing may still be writing: abandon() waits for each launched
    # collective (on a GPU its input may otherwise be freed and reused while it reads it) and
    # hands nothing over; the next backward starts clean.
    from lomo_kernels.distributed import reduce_scatter as module

    launched = []

    class Work:
        def __init__(self) -> None:
            self.waited = False
            launched.append(self)

        def wait(self) -> bool:
            self.waited = True
            return True

    def deferred(output, packed, **kwargs):  # the reduction itself, left to wait() to finish
        output.copy_(packed)
        return Work()

    monkeypatch.setattr(module, "reduce_scatter", deferred)
    reducer = ReduceScatterBuckets(bucket_numel=10, max_inflight=3)
    reducer.begin()
    handed = []
    for shard, grad in _shards(group, [4, 5, 6, 3, 3, 12]):
        handed += reducer.add(shard, grad, grad.numel())
    assert handed == [] and len(launched) == 3  # (4, 5), (6, 3) and (12) in flight, (3) open
    reducer.abandon()
    assert all(work.waited for work in launched)
    assert list(reducer.finish()) == []  # the open bucket was dropped too
    reducer.begin()  # no "previous backward pass left gradients unreduced"
