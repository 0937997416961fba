"""Sharded training: the optimizer updates only this rank's slice of each parameter.

`sharding_for` looks at the trainable parameters once, at construction, and returns the
`Zero3Sharding` that routes their gradients (DeepSpeed ZeRO-3), or None for one process.
Set-ups that would train wrongly (replicated data parallelism, where each rank would apply
its own unreduced gradient) are refused there, before any hook exists.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from .reduce_scatter import (
    DEFAULT_BUCKET_NUMEL,
    DEFAULT_MAX_INFLIGHT,
    Consumer,
    ReduceScatterBuckets,
    all_gather,
)
from .shard import Shard
from .zero3 import (
    SUPPORTED_SETUP,
    check_zero3_params,
    is_zero3_param,
    partition_size,
    refresh_gathered,
    unwrap_engine,
    zero3_shard,
)

__all__ = [
    "DEFAULT_BUCKET_NUMEL",
    "Shard",
    "Zero3Sharding",
    "consolidated_state_dict",
    "sharding_for",
    "unwrap_engine",
]


class Zero3Sharding:
    """Routes full local gradients to their owner ranks and refreshes gathered copies."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        names: dict[int, str],
        bucket_numel: int,
        max_inflight: int,
    ) -> None:
        self.group = check_zero3_params(params, names)
        self.params = list(params)
        self.reducer = ReduceScatterBuckets(bucket_numel, max_inflight)

    def shard(self, param: nn.Parameter) -> Shard:
        return zero3_shard(param)

    def full_shape(self, param: nn.Parameter) -> torch.Size:
        return torch.Size(param.ds_shape)

    def begin(self, consume: Consumer) -> None:
        self.reducer.begin(consume)

    def grad_ready(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        if tuple(grad.shape) != tuple(param.ds_shape):
            raise RuntimeError(
                f"ZeRO-3 parameter ds_id={param.ds_id}: gradient of shape {tuple(grad.shape)}, "
                f"expected the full shape {tuple(param.ds_shape)}. " + SUPPORTED_SETUP
            )
        self.reducer.add(zero3_shard(param), grad, partition_size(param))

    def finish(self) -> None:
        self.reducer.finish()

    def abandon(self) -> None:
        self.reducer.abandon()

    def all_reduce_sum_(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)

    def after_update(self) -> None:
        refresh_gathered(self.params)

    def gather_slices(self, param: nn.Parameter, values: torch.Tensor) -> torch.Tensor:
        """The full flat tensor whose slice `values` is on this rank (a collective)."""
        size = partition_size(param)
        world = dist.get_world_size(self.group)
        padded = torch.zeros(size, dtype=values.dtype, device=values.device)
        padded[: values.numel()] = values.reshape(-1)
        full = torch.empty(world * size, dtype=values.dtype, device=values.device)
        all_gather(full, padded, group=self.group)
        return full[: int(param.ds_numel)]


def sharding_for(
    params: Sequence[nn.Parameter],
    names: dict[int, str],
    *,
    bucket_numel: int = DEFAULT_BUCKET_NUMEL,
    max_inflight: int = DEFAULT_MAX_INFLIGHT,
) -> Zero3Sharding | None:
    """The sharding engine behind `params`, or None when one process holds them whole."""
    if any(is_zero3_param(p) for p in params):
        return Zero3Sharding(params, names, bucket_numel, max_inflight)
    for p in params:
        if type(p).__name__ == "DTensor" or type(p.data).__name__ == "DTensor":
            raise ValueError(
                f"parameter {names.get(id(p), '?')!r} is a DTensor (FSDP2 / tensor "
                "parallelism), which this version does not update; use DeepSpeed ZeRO-3 "
                "(see README, 'Sharded training') or one process."
            )
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(
            f"torch.distributed runs {dist.get_world_size()} ranks but the parameters are "
            "whole on every rank (DDP, ZeRO stage 1/2, or no wrapper): each rank would apply "
            "its own unreduced gradient and the replicas would drift apart. Shard the model "
            "with DeepSpeed ZeRO-3 (README, 'Sharded training'), or run one process."
        )
    return None


def consolidated_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full, unsharded state dict of a ZeRO-3 model, on every rank (a collective).

    Loads into the same model built in one process (``model.load_state_dict``): the keys of
    its ``state_dict()`` (persistent buffers, tied parameters under each name).
    """
    model = unwrap_engine(model)
    state: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        state[name] = gather_full(p) if is_zero3_param(p) else p.detach().clone()
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, b in module.named_buffers(recurse=False):
            if b is not None and name not in module._non_persistent_buffers_set:
                state[f"{prefix}.{name}" if prefix else name] = b.detach().clone()
    return state


def gather_full(param: nn.Parameter) -> torch.Tensor:
    """The full value of a ZeRO-3 parameter, assembled from every rank's partition."""
    group = param.ds_process_group
    local = param.ds_tensor.data.view(-1)
    world = dist.get_world_size(group)
    full = torch.empty(world * local.numel(), dtype=local.dtype, device=local.device)
    all_gather(full, local.contiguous(), group=group)
    return full[: int(param.ds_numel)].view(param.ds_shape).clone()
