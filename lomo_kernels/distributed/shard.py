"""The slice of a parameter this rank updates, whatever engine sharded it.

A sharding engine (DeepSpeed ZeRO-3, FSDP2) stores each parameter split over the ranks of a
process group. The optimizer only needs to know, for each parameter: the local tensor it
must update in place, where that tensor sits in the flattened full parameter, and the full
shape (AdaLomo's factored statistics are indexed by row and column of the full tensor).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Shard:
    """This rank's part of one parameter.

    `local` is a 1-D view of the elements this rank owns (padding excluded; possibly empty),
    updated in place. It covers flat elements ``[offset, offset + local.numel())`` of the full
    parameter, whose shape is `full_shape`. `group` is the process group the parameter is
    sharded over and whose ranks hold the other slices.
    """

    param: torch.nn.Parameter
    local: torch.Tensor
    offset: int
    full_shape: torch.Size
    group: dist.ProcessGroup

    @property
    def full_numel(self) -> int:
        return self.full_shape.numel()


# One batch of reduced gradients a sharding hands over: this rank's shard of each parameter
# with its slice of the averaged gradient, in the order every rank sees them.
ShardGrads = list[tuple[Shard, torch.Tensor]]


def refuse_partial_world(group: object, engine: str, setup: str) -> None:
    """Refuses parameters sharded over fewer ranks than the job has: `engine` combined with
    another kind of parallelism, whose gradients would be averaged over the shard group
    only. `setup`: the engine's supported set-up, appended to the message."""
    world = dist.get_world_size(group)
    if world != dist.get_world_size():
        raise ValueError(
            f"the parameters are sharded over {world} of {dist.get_world_size()} ranks "
            f"({engine} combined with another kind of parallelism): not supported, the "
            "gradients would be averaged over the shard group only. " + setup
        )
