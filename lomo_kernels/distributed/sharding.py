"""The one interface between the optimizer and a sharding engine: the optimizer calls it,
it never calls the optimizer.

A sharding only moves data: it takes each parameter's gradient as autograd delivers it,
returns this rank's reduced slices in batches (`ShardGrads`) once they are ready, reduces
the small tensors the optimizer asks it to, and refreshes the engine's gathered copies after
the update. What to do with a batch (measure it, update it) is the optimizer's business.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch
from torch import nn

from .shard import Shard, ShardGrads


class Sharding(Protocol):
    """What the optimizer needs of a sharding engine (ZeRO-3, FSDP2)."""

    # Whether the graph of one loss can be back-propagated twice (the norm pass, then the
    # update pass): DeepSpeed ZeRO-3 releases the gathered parameters after a backward.
    second_backward_ok: bool

    def shard(self, param: nn.Parameter) -> Shard:
        """This rank's slice of `param`."""
        ...

    def begin(self) -> None:
        """Starts a backward pass (refuses one that cannot hand the gradients over)."""
        ...

    def grad_ready(self, param: nn.Parameter, grad: torch.Tensor) -> list[ShardGrads]:
        """Takes the gradient autograd delivered for `param`; returns the batches of reduced
        slices that became ready, in order (often none)."""
        ...

    def finish(self) -> Iterable[ShardGrads]:
        """The batches still pending at the end of backward, in order, each handed over as
        it is ready: iterate to the end."""
        ...

    def abandon(self) -> None:
        """Drops everything pending after a failed backward."""
        ...

    def all_reduce_sum_(self, tensor: torch.Tensor) -> None:
        """Sums `tensor` in place over the ranks holding the other slices (a collective)."""
        ...

    def after_update(self) -> None:
        """Brings the engine's gathered copies of the parameters up to date."""
        ...

    def gather_slices(self, param: nn.Parameter, values: torch.Tensor) -> torch.Tensor:
        """The full flat tensor whose slice `values` (shaped like this rank's slice of
        `param`) is on this rank (a collective)."""
        ...

    def slice_as_dtensor(self, param: nn.Parameter, values: torch.Tensor) -> torch.Tensor:
        """`values` (shaped like this rank's slice of `param`, sharing its storage) as the
        DTensor whose local part they are, laid out over the ranks as `param` is: the form
        torch.distributed.checkpoint saves per shard and reshards on load."""
        ...
