"""The few collectives a checkpoint needs, which are no-ops in one process: every rank
reaches the same outcome, so a refusal is raised on all of them alike."""

from __future__ import annotations

from typing import Any, TypeVar

import torch.distributed as dist

from .manifest import CheckpointError

T = TypeVar("T")


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if distributed() else 1


def barrier() -> None:
    if distributed():
        dist.barrier()


def gathered(value: T) -> list[T]:
    """Every rank's `value`, in rank order."""
    if not distributed():
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def from_rank0(value: T) -> T:
    """Rank 0's `value`, on every rank."""
    if not distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def agree(error: Exception | None) -> None:
    """Raises the lowest rank's refusal on every rank when any rank has one (that rank's own
    exception there, a `CheckpointError` with the same message elsewhere)."""
    errors = gathered(None if error is None else str(error))
    first = next((e for e in errors if e is not None), None)
    if first is None:
        return
    if error is not None and str(error) == first:
        raise error
    raise CheckpointError(first)
