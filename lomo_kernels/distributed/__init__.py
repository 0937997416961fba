"""Sharded training: the optimizer updates only this rank's slice of each parameter.

`sharding_for` looks at the trainable parameters once, at construction, and returns the
object that routes their gradients: `Zero3Sharding` (DeepSpeed ZeRO-3: full local gradients,
reduce-scattered by us) or `Fsdp2Sharding` (FSDP2: gradients arrive reduced, one shard per
rank), or None for one process. Both hand the optimizer this rank's `Shard`s with their
reduced gradients, so one update path serves both engines. Set-ups that would train wrongly
(replicated data parallelism, where each rank would apply its own unreduced gradient) are
refused there, before any hook exists.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from .fsdp2 import SUPPORTED_SETUP as FSDP2_SETUP
from .fsdp2 import (
    check_fsdp2_params,
    compute_dtype,
    fsdp2_shard,
    fsdp_params_of,
    is_dtensor,
    refresh_unsharded,
    row_range,
    unsynced_units,
)
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
    "Fsdp2Sharding",
    "Shard",
    "Zero3Sharding",
    "compute_dtypes",
    "consolidated_state_dict",
    "sharding_for",
    "unwrap_engine",
]


class Zero3Sharding:
    """Routes full local gradients to their owner ranks and refreshes gathered copies."""

    # DeepSpeed releases the gathered parameters after a backward: no second one per graph.
    second_backward_ok = False

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


class Fsdp2Sharding:
    """Hands FSDP2's reduced gradient shards to the optimizer, one FSDP2 unit at a time.

    FSDP2 reduce-scatters a unit's gradients and then calls the hooks of its parameters one
    after the other; the shards are collected and handed over together when the unit's last
    trainable parameter arrives (or when another unit's does, or at the end of backward), so
    AdaLomo's cross-rank statistics cost two small all-reduces per unit, not per parameter.
    The shards handed over are views of FSDP2's reduce-scatter output, which it keeps until
    the hooks of its unit have run; nothing is held after that.
    """

    # The graph of one loss can be back-propagated twice (lomo-optim's one-loss pattern):
    # FSDP2 gathers the parameters again in each backward.
    second_backward_ok = True

    def __init__(
        self, model: nn.Module, params: Sequence[nn.Parameter], names: dict[int, str]
    ) -> None:
        self.group, managed = check_fsdp2_params(model, params, names)
        self.model = model
        self._unit_of = {key: unit for key, (unit, _) in managed.items()}
        self._unit_size: dict[int, int] = {}
        for unit in self._unit_of.values():
            self._unit_size[unit] = self._unit_size.get(unit, 0) + 1
        self._pending: list[tuple[Shard, torch.Tensor]] = []
        self._pending_unit: int | None = None
        self._consume: Consumer | None = None

    def shard(self, param: nn.Parameter) -> Shard:
        return fsdp2_shard(param, self.group)

    def full_shape(self, param: nn.Parameter) -> torch.Size:
        return torch.Size(param.shape)

    def begin(self, consume: Consumer) -> None:
        if self._pending:
            raise RuntimeError("a previous backward pass left gradient shards unconsumed")
        if unsynced_units(self.model):
            raise RuntimeError(
                "FSDP2 gradient synchronisation is off (set_requires_gradient_sync(False)): "
                "FSDP2 would accumulate the gradients and never hand them to the optimizer. "
                "LOMO updates inside backward and cannot accumulate gradients; keep "
                "synchronisation on and use a larger batch. " + FSDP2_SETUP
            )
        self._consume = consume

    def grad_ready(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        if not is_dtensor(grad):
            raise RuntimeError(
                f"FSDP2 parameter {self._name(param)!r}: the gradient is not a DTensor shard; "
                "was fused_backward used, with gradient synchronisation on? " + FSDP2_SETUP
            )
        shard = self.shard(param)
        local = grad.to_local()
        if local.numel() != shard.local.numel():
            raise RuntimeError(
                f"FSDP2 parameter {self._name(param)!r}: gradient shard of shape "
                f"{tuple(local.shape)}, expected {tuple(param.to_local().shape)}. " + FSDP2_SETUP
            )
        unit = self._unit_of[id(param)]
        if self._pending and unit != self._pending_unit:
            self._flush()  # a unit some of whose parameters got no gradient
        self._pending.append((shard, local.reshape(-1)))
        self._pending_unit = unit
        if len(self._pending) == self._unit_size[unit]:
            self._flush()

    def finish(self) -> None:
        self._flush()
        self._consume = None

    def abandon(self) -> None:
        self._pending.clear()
        self._pending_unit = None
        self._consume = None

    def all_reduce_sum_(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)

    def after_update(self) -> None:
        refresh_unsharded(self.model)

    def gather_slices(self, param: nn.Parameter, values: torch.Tensor) -> torch.Tensor:
        """The full flat tensor whose slice `values` is on this rank (a collective)."""
        world = dist.get_world_size(self.group)
        rows = param.shape[0] if param.dim() else 1
        row_numel = param.numel() // rows if rows else 0
        chunk = row_range(rows, world, 0)[1] * row_numel
        padded = torch.zeros(chunk, dtype=values.dtype, device=values.device)
        padded[: values.numel()] = values.reshape(-1)
        full = torch.empty(world * chunk, dtype=values.dtype, device=values.device)
        all_gather(full, padded, group=self.group)
        return full[: param.numel()]

    def _flush(self) -> None:
        ready, self._pending, self._pending_unit = self._pending, [], None
        if not ready:
            return
        if self._consume is None:
            raise RuntimeError("gradient shards arrived outside a backward pass")
        self._consume(ready)

    def _name(self, param: nn.Parameter) -> str:
        return next((n for n, p in self.model.named_parameters() if p is param), "?")


def sharding_for(
    params: Sequence[nn.Parameter],
    names: dict[int, str],
    *,
    model: nn.Module | None = None,
    bucket_numel: int = DEFAULT_BUCKET_NUMEL,
    max_inflight: int = DEFAULT_MAX_INFLIGHT,
) -> Zero3Sharding | Fsdp2Sharding | None:
    """The sharding engine behind `params`, or None when one process holds them whole.

    `model` (the module owning `params`) is needed to find FSDP2's units.
    """
    zero3 = [p for p in params if is_zero3_param(p)]
    dtensors = [p for p in params if is_dtensor(p)]
    if zero3 and dtensors:
        raise ValueError(
            f"parameter {names.get(id(zero3[0]), '?')!r} is partitioned by DeepSpeed ZeRO-3 "
            f"and {names.get(id(dtensors[0]), '?')!r} is a DTensor (FSDP2): use one engine."
        )
    if zero3:
        return Zero3Sharding(params, names, bucket_numel, max_inflight)
    if dtensors or (model is not None and any(True for _ in fsdp_params_of(model))):
        if model is None:
            raise ValueError("FSDP2 parameters found: pass the model to find its units")
        return Fsdp2Sharding(model, params, names)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(
            f"torch.distributed runs {dist.get_world_size()} ranks but the parameters are "
            "whole on every rank (DDP, ZeRO stage 1/2, or no wrapper): each rank would apply "
            "its own unreduced gradient and the replicas would drift apart. Shard the model "
            "with FSDP2 (fully_shard) or DeepSpeed ZeRO-3 (README, 'Sharded training'), or "
            "run one process."
        )
    return None


def compute_dtypes(model: nn.Module, params: Sequence[nn.Parameter]) -> list[torch.dtype]:
    """The dtype each parameter's forward and backward run in.

    The parameter's own dtype, except under FSDP2 with a MixedPrecisionPolicy, whose
    ``param_dtype`` the gathered parameters (and so the gradients) have.
    """
    policy = {id(fp.sharded_param): compute_dtype(fp) for _, fp in fsdp_params_of(model)}
    return [policy.get(id(p), p.dtype) for p in params]


def consolidated_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full, unsharded state dict of a ZeRO-3 or FSDP2 model, on every rank (a collective).

    Loads into the same model built in one process (``model.load_state_dict``): the keys of
    its ``state_dict()`` (persistent buffers, tied parameters under each name).
    """
    model = unwrap_engine(model)
    state: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if is_zero3_param(p):
            state[name] = gather_full(p)
        elif is_dtensor(p):
            state[name] = p.detach().full_tensor().clone()
        else:
            state[name] = p.detach().clone()
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, b in module.named_buffers(recurse=False):
            if b is not None and name not in module._non_persistent_buffers_set:
                value = b.detach().full_tensor() if is_dtensor(b) else b.detach()
                state[f"{prefix}.{name}" if prefix else name] = value.clone()
    return state


def gather_full(param: nn.Parameter) -> torch.Tensor:
    """The full value of a ZeRO-3 parameter, assembled from every rank's partition."""
    group = param.ds_process_group
    local = param.ds_tensor.data.view(-1)
    world = dist.get_world_size(group)
    full = torch.empty(world * local.numel(), dtype=local.dtype, device=local.device)
    all_gather(full, local.contiguous(), group=group)
    return full[: int(param.ds_numel)].view(param.ds_shape).clone()
