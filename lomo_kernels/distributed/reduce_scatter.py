"""Bucketed, asynchronous reduce-scatter of full local gradients to their owner ranks.

Each rank holds a full-shape, unreduced gradient of a parameter; rank r needs the average
over ranks of flat elements ``[r*S, (r+1)*S)`` (S = the partition size) and nothing else.
A reduce-scatter delivers exactly that at half the traffic of an all-reduce.

Gradients are packed into buckets as they arrive: a bucket's input holds W rank segments,
and each segment the slices of every parameter in the bucket that the rank owns (zero
padded). When the next gradient would overflow the bucket, the bucket is packed into one
buffer and its collective is launched asynchronously, so communication overlaps the rest of
backward; the gradients are dropped once packed. A bucket's reduced partitions are returned
to the caller (the optimizer, which updates them) once its collective has completed: by
`add` when `max_inflight` newer buckets are in flight, the rest by `finish()`.

A gradient larger than a bucket goes alone, without a copy when its size divides evenly.

Memory held by this class at any time, in elements of the gradient dtype: the gradients
waiting in the open bucket (< bucket_numel, or one larger gradient), the packed buffer
being filled (same), and up to `max_inflight` launched inputs (bucket_numel each, or one
large gradient each) with their outputs (1/W of that): at most
``(max_inflight + 2) * max(bucket_numel, largest padded gradient)`` plus the outputs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .shard import Shard, ShardGrads

DEFAULT_BUCKET_NUMEL = 1 << 24  # 16M elements: 32 MiB in bf16, large enough for full bandwidth
DEFAULT_MAX_INFLIGHT = 2


@dataclass
class _Entry:
    shard: Shard
    grad: torch.Tensor | None  # full local gradient, dropped once packed
    size: int  # partition size S (padded)
    out_offset: int  # where its partition starts in the bucket's output


@dataclass
class _Bucket:
    dtype: torch.dtype
    device: torch.device
    group: dist.ProcessGroup
    entries: list[_Entry] = field(default_factory=list)
    local_numel: int = 0  # sum of partition sizes


@dataclass
class _InFlight:
    work: dist.Work | None
    output: torch.Tensor
    entries: list[_Entry]
    keep_alive: torch.Tensor  # the input, until the collective is done


class ReduceScatterBuckets:
    """Packs gradients into buckets and reduce-scatters each bucket with one collective."""

    def __init__(
        self,
        bucket_numel: int = DEFAULT_BUCKET_NUMEL,
        max_inflight: int = DEFAULT_MAX_INFLIGHT,
    ) -> None:
        if int(bucket_numel) < 1:
            raise ValueError(f"bucket_numel must be >= 1, got {bucket_numel}")
        if int(max_inflight) < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        self.bucket_numel = int(bucket_numel)
        self.max_inflight = int(max_inflight)
        self._open: dict[tuple[torch.dtype, torch.device, int], _Bucket] = {}
        self._inflight: deque[_InFlight] = deque()
        self.collectives_launched = 0

    def begin(self) -> None:
        """Starts a backward pass."""
        if self._open or self._inflight:
            raise RuntimeError("a previous backward pass left gradients unreduced")

    def add(self, shard: Shard, grad: torch.Tensor, size: int) -> list[ShardGrads]:
        """Queues the full local gradient of `shard.param` (partition size `size`); returns
        the buckets whose collectives completed meanwhile, oldest first."""
        world = dist.get_world_size(shard.group)
        key = (grad.dtype, grad.device, id(shard.group))
        entry = _Entry(shard, grad, size, 0)
        if world * size >= self.bucket_numel:
            return self._launch_alone(entry, world)
        bucket = self._open.get(key)
        ready = []
        if bucket is not None and world * (bucket.local_numel + size) > self.bucket_numel:
            ready = self._launch(self._open.pop(key))
            bucket = None
        if bucket is None:
            bucket = self._open[key] = _Bucket(grad.dtype, grad.device, shard.group)
        entry.out_offset = bucket.local_numel
        bucket.entries.append(entry)
        bucket.local_numel += size
        return ready

    def finish(self) -> Iterator[ShardGrads]:
        """Launches the open buckets and yields every remaining bucket's reduced partitions
        as its collective completes, oldest first (one bucket's output held at a time)."""
        for key in list(self._open):
            yield from self._launch(self._open.pop(key))
        while self._inflight:
            yield self._complete_oldest()

    def abandon(self) -> None:
        """Drops everything queued (after a failed backward): nothing is returned."""
        self._open.clear()
        while self._inflight:
            pending = self._inflight.popleft()
            if pending.work is not None:
                pending.work.wait()

    # -- internals --------------------------------------------------------------------
    def _launch(self, bucket: _Bucket) -> list[ShardGrads]:
        world = dist.get_world_size(bucket.group)
        total = bucket.local_numel
        packed = torch.empty(world * total, dtype=bucket.dtype, device=bucket.device)
        rows = packed.view(world, total)
        for entry in bucket.entries:
            _pack(rows[:, entry.out_offset : entry.out_offset + entry.size], entry, world)
            entry.grad = None
        return self._start(packed, bucket.entries, bucket.group, total)

    def _launch_alone(self, entry: _Entry, world: int) -> list[ShardGrads]:
        grad = entry.grad.reshape(-1)
        if grad.numel() == world * entry.size:
            packed = grad  # already in rank-major order: no copy
        else:
            packed = torch.empty(world * entry.size, dtype=grad.dtype, device=grad.device)
            _pack(packed.view(world, entry.size), entry, world)
        entry.grad = None
        return self._start(packed, [entry], entry.shard.group, entry.size)

    def _start(
        self, packed: torch.Tensor, entries: list[_Entry], group: dist.ProcessGroup, total: int
    ) -> list[ShardGrads]:
        """Launches one collective; returns the buckets completed to stay within
        `max_inflight`."""
        output = torch.empty(total, dtype=packed.dtype, device=packed.device)
        work = reduce_scatter(output, packed, op=dist.ReduceOp.AVG, group=group, async_op=True)
        self.collectives_launched += 1
        self._inflight.append(_InFlight(work, output, entries, packed))
        ready = []
        while len(self._inflight) > self.max_inflight:
            ready.append(self._complete_oldest())
        return ready

    def _complete_oldest(self) -> ShardGrads:
        pending = self._inflight.popleft()
        if pending.work is not None:
            pending.work.wait()
        pending.keep_alive = None
        ready = []
        for entry in pending.entries:
            owned = entry.shard.local.numel()
            ready.append((entry.shard, pending.output[entry.out_offset : entry.out_offset + owned]))
        return ready


def reduce_scatter(output: torch.Tensor, packed: torch.Tensor, **kwargs: Any) -> dist.Work | None:
    """`reduce_scatter_single` (torch >= 2.13), else its older name."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, packed, **kwargs)


def all_gather(output: torch.Tensor, local: torch.Tensor, **kwargs: Any) -> dist.Work | None:
    """`all_gather_single` (torch >= 2.13), else its older name."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, local, **kwargs)


def gather_padded(
    values: torch.Tensor, chunk: int, numel: int, group: dist.ProcessGroup
) -> torch.Tensor:
    """The first `numel` elements of every rank's `values` (each padded to `chunk`), in rank
    order: a sliced flat tensor made whole again (a collective)."""
    world = dist.get_world_size(group)
    padded = torch.zeros(chunk, dtype=values.dtype, device=values.device)
    padded[: values.numel()] = values.reshape(-1)
    full = torch.empty(world * chunk, dtype=values.dtype, device=values.device)
    all_gather(full, padded, group=group)
    return full[:numel]


def _pack(rows: torch.Tensor, entry: _Entry, world: int) -> None:
    """Writes the flat gradient into `rows` ([W, S] view): row r = rank r's slice, padded."""
    flat = entry.grad.reshape(-1)
    size = entry.size
    full = min(flat.numel() // size, world)
    if full:
        rows[:full].copy_(flat[: full * size].view(full, size))
    if full < world:
        rest = flat.numel() - full * size
        rows[full, :rest].copy_(flat[full * size :])
        rows[full, rest:].zero_()
        rows[full + 1 :].zero_()
