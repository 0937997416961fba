"""DeepSpeed ZeRO-3: find the parameters it partitioned and say what this rank owns.

With ZeRO-3 (and no optimizer passed to ``deepspeed.initialize``) DeepSpeed gathers each
parameter for the forward and backward of its module and releases it after; between, the
parameter's ``data`` is empty and its values live in ``param.ds_tensor``: this rank's flat
partition of ``ceil(ds_numel / W)`` elements (W = size of ``param.ds_process_group``), the
last ones padding. Autograd still writes a full-shape, local, unreduced ``param.grad``, so
the optimizer reduce-scatters it (see `reduce_scatter.py`) and updates ``ds_tensor``.

Everything DeepSpeed-specific is read here, from DeepSpeed's own parameter attributes; the
rest of the package sees `Shard`s.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..core.torch_internals import post_accumulate_grad_hooks
from .reduce_scatter import ReduceScatterBuckets, all_gather, gather_padded
from .shard import Shard, ShardGrads, refuse_partial_world

SUPPORTED_SETUP = (
    "Supported: DeepSpeed ZeRO stage 3 with no optimizer passed to deepspeed.initialize "
    "(the Lomo/AdaLomo hooks reduce and apply the gradients), no parameter offload, one "
    "partition group (no hpZ / MiCS), the forward called on the module itself "
    "(engine.module(...) or the model you passed in), and fused_backward(loss) for the "
    "backward. See README, 'Sharded training'."
)


def is_zero3_param(param: torch.Tensor) -> bool:
    """True for a parameter that DeepSpeed ZeRO-3 partitioned (it carries ``ds_tensor``)."""
    return getattr(param, "ds_tensor", None) is not None and hasattr(param, "ds_process_group")


def is_deepspeed_engine(model: object) -> bool:
    """True for a DeepSpeed engine (without importing DeepSpeed)."""
    return hasattr(model, "zero_optimization_stage") and hasattr(model, "module")


def unwrap_engine(model: nn.Module) -> nn.Module:
    """The module of a DeepSpeed engine, after refusing engines that cannot be served."""
    if not is_deepspeed_engine(model):
        return model
    stage = model.zero_optimization_stage()
    if stage != 3:
        raise ValueError(
            f"the DeepSpeed engine uses ZeRO stage {stage}; LOMO needs stage 3 (parameters "
            "partitioned, gradients reduced by the optimizer's own hooks) or no DeepSpeed. "
            "Set zero_optimization.stage = 3. " + SUPPORTED_SETUP
        )
    if model.optimizer is not None and not _is_param_only(model.optimizer):
        raise ValueError(
            "an optimizer was passed to deepspeed.initialize; DeepSpeed's ZeRO-3 optimizer "
            "would reduce and keep gradient partitions itself. Call deepspeed.initialize "
            "without optimizer= and build Lomo/AdaLomo on the engine. " + SUPPORTED_SETUP
        )
    if model.zero_offload_param():
        raise ValueError(
            "zero_optimization.offload_param is set: the partitions live off the device the "
            "gradients arrive on, which LOMO does not serve. Remove offload_param. "
            + SUPPORTED_SETUP
        )
    return model.module


def _is_param_only(optimizer: object) -> bool:
    # With no optimizer, stage 3 still builds DeepSpeedZeRoOffload (gather/release hooks only).
    return type(optimizer).__name__ == "DeepSpeedZeRoOffload"


def check_zero3_params(params: Sequence[nn.Parameter], names: dict[int, str]) -> dist.ProcessGroup:
    """Refuses set-ups this path cannot update correctly; returns the partition group."""
    sharded = [p for p in params if is_zero3_param(p)]
    if len(sharded) != len(params):
        plain = next(names.get(id(p), "?") for p in params if not is_zero3_param(p))
        raise ValueError(
            f"parameter {plain!r} is not partitioned by ZeRO-3 while others are; build the "
            "whole model under deepspeed.zero.Init (or pass it to deepspeed.initialize with "
            "stage 3) so every trainable parameter is partitioned. " + SUPPORTED_SETUP
        )
    group = sharded[0].ds_process_group
    for p in sharded:
        name = names.get(id(p), "?")
        if p.ds_process_group is not group:
            raise ValueError(
                f"parameter {name!r} is partitioned over another process group than the "
                "first parameter (hpZ / MiCS): not supported. " + SUPPORTED_SETUP
            )
        if getattr(p, "ds_secondary_tensor", None) is not None:
            raise ValueError(
                f"parameter {name!r} has a secondary partition (zero_hpz_partition_size > 1): "
                "not supported. " + SUPPORTED_SETUP
            )
        if getattr(p.ds_tensor, "final_location", None) is not None or p.ds_tensor.device != (
            p.device
        ):
            raise ValueError(
                f"parameter {name!r} is offloaded ({p.ds_tensor.device}, "
                f"{getattr(p.ds_tensor, 'final_location', None)}): parameter offload is not "
                "supported. " + SUPPORTED_SETUP
            )
        if _has_deepspeed_reduce_hook(p):
            raise ValueError(
                f"parameter {name!r} belongs to a DeepSpeed ZeRO-3 optimizer (an optimizer was "
                "passed to deepspeed.initialize), whose hooks would also reduce its gradient. "
                + SUPPORTED_SETUP
            )
    refuse_partial_world(group, "ZeRO-3", SUPPORTED_SETUP)
    return group


def _has_deepspeed_reduce_hook(param: nn.Parameter) -> bool:
    """Whether DeepSpeed's ZeRO-3 optimizer hooked this parameter's gradient."""
    # Without an optimizer DeepSpeed registers no post-accumulate hook; its ZeRO-3 optimizer
    # registers one per parameter (wrapped by its NVTX instrumentation).
    hooks = post_accumulate_grad_hooks(param)
    return any(getattr(h, "__module__", "").startswith("deepspeed") for h in hooks.values())


def partition_size(param: nn.Parameter) -> int:
    """Elements of every rank's partition (padded): ``ceil(ds_numel / W)``, as DeepSpeed sets."""
    return int(param.ds_tensor.ds_numel)


def zero3_shard(param: nn.Parameter) -> Shard:
    """This rank's owned, unpadded part of ``param.ds_tensor``."""
    group = param.ds_process_group
    rank = dist.get_rank(group)
    size = partition_size(param)
    numel = int(param.ds_numel)
    start = min(rank * size, numel)
    owned = min(size, numel - start)  # 0 for a rank that holds only padding
    return Shard(
        param=param,
        local=param.ds_tensor.data.view(-1)[:owned],
        offset=start,
        full_shape=torch.Size(param.ds_shape),
        group=group,
    )


def flat_dtensor(shard: Shard, values: torch.Tensor) -> torch.Tensor:
    """`values` (shaped like ``shard.local``, sharing its storage) as a flat DTensor of the
    full parameter's ``numel`` elements, ``Shard(0)`` over the partition group.

    DeepSpeed's partitions are DTensor's ``torch.chunk`` layout of the flat parameter (rank r
    owns ``[r*c, min((r+1)*c, numel))``, ``c = ceil(numel / W)``), so
    torch.distributed.checkpoint saves each rank's part and reshards it on load.
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Shard as ShardPlacement

    numel = shard.full_numel
    world, rank = dist.get_world_size(shard.group), dist.get_rank(shard.group)
    chunk = -(-numel // world)
    if shard.offset != min(rank * chunk, numel) or values.numel() != shard.local.numel():
        raise ValueError(
            f"ZeRO-3 parameter ds_id={shard.param.ds_id}: this rank's partition starts at "
            f"{shard.offset} with {shard.local.numel()} elements, not DTensor's torch.chunk "
            f"layout of {numel} elements over {world} ranks. " + SUPPORTED_SETUP
        )
    key = (shard.group, values.device.type)
    mesh = _MESHES.get(key)
    if mesh is None:
        mesh = _MESHES[key] = DeviceMesh.from_group(shard.group, values.device.type)
    return DTensor.from_local(
        values.view(-1), mesh, [ShardPlacement(0)], shape=(numel,), stride=(1,), run_check=False
    )


# One device mesh per partition group and device type, built on first use.
_MESHES: dict[tuple[dist.ProcessGroup, str], object] = {}


def is_gathered(param: nn.Parameter) -> bool:
    """Whether DeepSpeed holds a full copy in ``param.data`` now (persistent or cached)."""
    return param.ds_status.name != "NOT_AVAILABLE"


def refresh_gathered(params: Iterable[nn.Parameter]) -> int:
    """Copies the updated partitions into the full copies DeepSpeed keeps; returns how many.

    Persistent parameters (``ds_persist``) and any other parameter left gathered keep a full
    ``param.data`` that the next forward uses as is. One all-gather per (dtype, device) of all
    their partitions, concatenated, brings them up to date.
    """
    kept = [p for p in params if is_gathered(p)]
    for p in kept:
        if p.ds_status.name == "INFLIGHT":
            raise RuntimeError(
                f"ZeRO-3 parameter ds_id={p.ds_id} is being gathered while its partition was "
                "updated; the next forward could see stale values. " + SUPPORTED_SETUP
            )
    by_kind: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
    for p in kept:
        by_kind.setdefault((p.ds_tensor.dtype, p.ds_tensor.device), []).append(p)
    for group_params in by_kind.values():
        group = group_params[0].ds_process_group
        world = dist.get_world_size(group)
        local = torch.cat([p.ds_tensor.data.view(-1) for p in group_params])
        full = torch.empty(world * local.numel(), dtype=local.dtype, device=local.device)
        all_gather(full, local, group=group)
        rows = full.view(world, local.numel())
        offset = 0
        for p in group_params:
            size = partition_size(p)
            values = rows[:, offset : offset + size].reshape(-1)[: int(p.ds_numel)]
            p.data.view(-1).copy_(values)
            offset += size
    return len(kept)


def gather_full(param: nn.Parameter) -> torch.Tensor:
    """The full value of a ZeRO-3 parameter, assembled from every rank's partition."""
    group = param.ds_process_group
    local = param.ds_tensor.data.view(-1)
    world = dist.get_world_size(group)
    full = torch.empty(world * local.numel(), dtype=local.dtype, device=local.device)
    all_gather(full, local.contiguous(), group=group)
    return full[: int(param.ds_numel)].view(param.ds_shape).clone()


class Zero3Sharding:
    """The `Sharding` of DeepSpeed ZeRO-3: reduce-scatters full local gradients to their
    owner ranks (in buckets) and refreshes the gathered copies."""

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

    def begin(self) -> None:
        self.reducer.begin()

    def grad_ready(self, param: nn.Parameter, grad: torch.Tensor) -> list[ShardGrads]:
        if tuple(grad.shape) != tuple(param.ds_shape):
            raise RuntimeError(
                f"ZeRO-3 parameter ds_id={param.ds_id}: gradient of shape {tuple(grad.shape)}, "
                f"expected the full shape {tuple(param.ds_shape)}. " + SUPPORTED_SETUP
            )
        return self.reducer.add(zero3_shard(param), grad, partition_size(param))

    def finish(self) -> Iterator[ShardGrads]:
        return self.reducer.finish()

    def abandon(self) -> None:
        self.reducer.abandon()

    def all_reduce_sum_(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)

    def after_update(self) -> None:
        refresh_gathered(self.params)

    def gather_slices(self, param: nn.Parameter, values: torch.Tensor) -> torch.Tensor:
        return gather_padded(values, partition_size(param), int(param.ds_numel), self.group)

    def slice_as_dtensor(self, param: nn.Parameter, values: torch.Tensor) -> torch.Tensor:
        return flat_dtensor(zero3_shard(param), values)
