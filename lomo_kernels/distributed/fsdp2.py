"""FSDP2 (``torch.distributed.fsdp.fully_shard``): find its parameters, say what a rank owns.

FSDP2 replaces each parameter of a ``fully_shard``-ed module by a DTensor sharded on dim 0
over a 1-D device mesh: rank r holds rows ``[r*c, min((r+1)*c, rows))`` with
``c = ceil(rows / W)`` (``torch.chunk``; a rank may hold no row). After backward it
reduce-scatters each unit's gradients (averaged over the ranks) and then calls every sharded
parameter's post-accumulate-grad hooks itself, with ``param.grad`` the local shard of the
averaged gradient as a DTensor, in the sharded parameter's dtype. Nothing is left to reduce:
the optimizer updates ``param.to_local()`` in place, and the next forward all-gathers the
updated shards.

Everything FSDP2-specific is read here, from the ``FSDPParam`` objects of each unit; the
rest of the package sees `Shard`s.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..core.torch_internals import fsdp_param_group
from .reduce_scatter import gather_padded
from .shard import Shard, ShardGrads, refuse_partial_world

SUPPORTED_SETUP = (
    "Supported: FSDP2 (torch.distributed.fsdp.fully_shard) on a 1-D device mesh over all "
    "ranks, every trainable parameter inside a fully_shard-ed module, the default Shard(0) "
    "placement, no CPU offload, gradient synchronisation on, and fused_backward(loss) for the "
    "backward. See README, 'Sharded training (FSDP2)'."
)


def is_dtensor(param: torch.Tensor) -> bool:
    """True for a DTensor parameter (FSDP2 or tensor parallelism), without importing DTensor."""
    return type(param).__name__ == "DTensor" or type(param.data).__name__ == "DTensor"


def fsdp_params_of(model: nn.Module) -> Iterator[tuple[int, Any]]:
    """(unit index, ``FSDPParam``) for every parameter FSDP2 manages under `model`.

    A unit is one ``fully_shard`` call's parameter group: FSDP2 reduces it with one
    collective and then calls the hooks of its parameters one after the other.
    """
    unit = 0
    for module in model.modules():
        group = fsdp_param_group(module)
        if group is None:
            continue
        for fsdp_param in group.fsdp_params:
            yield unit, fsdp_param
        unit += 1


def check_fsdp2_params(
    model: nn.Module, params: Sequence[nn.Parameter], names: dict[int, str]
) -> tuple[dist.ProcessGroup, dict[int, tuple[int, Any]]]:
    """Refuses set-ups this path cannot update correctly.

    Returns the shard group and, per trainable parameter (by id), its unit and ``FSDPParam``.
    """
    managed = {id(fp.sharded_param): (unit, fp) for unit, fp in fsdp_params_of(model)}
    group = None
    for p in params:
        name = names.get(id(p), "?")
        if id(p) not in managed:
            kind = (
                "a DTensor not managed by FSDP2 (tensor parallelism?)"
                if is_dtensor(p)
                else ("whole on every rank")
            )
            raise ValueError(
                f"parameter {name!r} is {kind} while others are sharded by FSDP2: its gradient "
                "would not be reduced (or not handed to the optimizer). Apply fully_shard to "
                "the root module too, so every trainable parameter belongs to an FSDP2 unit. "
                + SUPPORTED_SETUP
            )
        _, fsdp_param = managed[id(p)]
        mesh = p.device_mesh
        if mesh.ndim != 1:
            raise ValueError(
                f"parameter {name!r} lives on a {mesh.ndim}-D device mesh {tuple(mesh.shape)} "
                f"with placements {p.placements} (HSDP, or FSDP2 combined with tensor "
                "parallelism): only a 1-D FSDP2 mesh is supported. " + SUPPORTED_SETUP
            )
        placement = p.placements[0]
        if not (placement.is_shard() and placement.dim == 0):
            raise ValueError(
                f"parameter {name!r} is placed {placement} (shard_placement_fn): only Shard(0) "
                "is supported; each rank's slice must be whole rows of the parameter. "
                + SUPPORTED_SETUP
            )
        if getattr(fsdp_param, "offload_to_cpu", False):
            raise ValueError(
                f"parameter {name!r} is offloaded to CPU (CPUOffloadPolicy): not supported. "
                + SUPPORTED_SETUP
            )
        p_group = mesh.get_group(0)
        if group is None:
            group = p_group
        elif p_group is not group and dist.get_process_group_ranks(
            p_group
        ) != dist.get_process_group_ranks(group):
            raise ValueError(
                f"parameter {name!r} is sharded over another process group than the first "
                "parameter: not supported. " + SUPPORTED_SETUP
            )
        if fsdp2_shard(p, p_group).local.numel() != p.to_local().numel():
            raise ValueError(
                f"parameter {name!r}: this rank holds {tuple(p.to_local().shape)} of "
                f"{tuple(p.shape)}, not the torch.chunk rows FSDP2 uses. " + SUPPORTED_SETUP
            )
    refuse_partial_world(group, "FSDP2", SUPPORTED_SETUP)
    return group, {id(p): managed[id(p)] for p in params}


def row_range(rows: int, world: int, rank: int) -> tuple[int, int]:
    """First row and row count of `rank`'s ``torch.chunk`` of `rows` rows (possibly none)."""
    chunk = -(-rows // world) if rows else 0
    start = min(rank * chunk, rows)
    return start, min(chunk, rows - start)


def fsdp2_shard(param: nn.Parameter, group: dist.ProcessGroup) -> Shard:
    """This rank's rows of an FSDP2 parameter, as a flat view of ``param.to_local()``."""
    shape = param.shape
    rows = shape[0] if len(shape) else 1
    row_numel = shape.numel() // rows if rows else 0
    start, count = row_range(rows, dist.get_world_size(group), dist.get_rank(group))
    with torch.no_grad():
        local = param.to_local().detach().view(-1)
    return Shard(
        param=param,
        local=local[: count * row_numel],
        offset=start * row_numel,
        full_shape=torch.Size(shape),
        group=group,
    )


def compute_dtype(fsdp_param: Any) -> torch.dtype:
    """The dtype FSDP2 computes the forward and backward in (MixedPrecisionPolicy)."""
    policy = getattr(fsdp_param, "mp_policy", None)
    dtype = getattr(policy, "param_dtype", None)
    return dtype or fsdp_param.sharded_param.dtype


def unsynced_units(model: nn.Module) -> int:
    """How many units have gradient synchronisation off (``set_requires_gradient_sync``).

    FSDP2 then accumulates their unsharded gradients and calls no hook (the optimizer's own
    ``accumulation_steps`` is the way to accumulate).
    """
    count = 0
    for module in model.modules():
        group = fsdp_param_group(module)
        count += group is not None and not getattr(group, "reduce_grads", True)
    return count


def refresh_unsharded(model: nn.Module) -> int:
    """Frees the unsharded parameters FSDP2 kept after backward; returns how many units.

    With ``reshard_after_backward=False`` (or after ``unshard()``) a unit keeps its gathered
    parameters, and its next forward would use them as they were before the update:
    resharding makes that forward all-gather the updated shards.
    """
    count = 0
    for module in model.modules():
        group = fsdp_param_group(module)
        if group is not None and not group.is_sharded:
            group.reshard()
            count += 1
    return count


class Fsdp2Sharding:
    """The `Sharding` of FSDP2: hands its reduced gradient shards over one unit at a time.

    FSDP2 reduce-scatters a unit's gradients and then calls the hooks of its parameters one
    after the other; the shards are collected and returned together when the unit's last
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
        self._pending: ShardGrads = []
        self._pending_unit: int | None = None

    def shard(self, param: nn.Parameter) -> Shard:
        return fsdp2_shard(param, self.group)

    def begin(self) -> None:
        if self._pending:
            raise RuntimeError("a previous backward pass left gradient shards pending")
        if unsynced_units(self.model):
            raise RuntimeError(
                "FSDP2 gradient synchronisation is off (set_requires_gradient_sync(False)): "
                "FSDP2 would accumulate the gradients and never hand them to the optimizer. "
                "The optimizer's hooks cannot accumulate gradients that FSDP2 keeps: keep "
                "synchronisation on, and to accumulate micro-batches build the optimizer with "
                "accumulation_steps=k. " + SUPPORTED_SETUP
            )

    def grad_ready(self, param: nn.Parameter, grad: torch.Tensor) -> list[ShardGrads]:
        if not is_dtensor(grad):
            raise RuntimeError(
                f"FSDP2 parameter {self._name(param)!r}: the gradient is not a DTensor shard; "
                "was fused_backward used, with gradient synchronisation on? " + SUPPORTED_SETUP
            )
        shard = self.shard(param)
        local = grad.to_local()
        if local.numel() != shard.local.numel():
            raise RuntimeError(
                f"FSDP2 parameter {self._name(param)!r}: gradient shard of shape "
                f"{tuple(local.shape)}, expected {tuple(param.to_local().shape)}. "
                + SUPPORTED_SETUP
            )
        unit = self._unit_of[id(param)]
        ready = []
        if self._pending and unit != self._pending_unit:
            ready.append(self._take_pending())  # a unit some of whose parameters got no gradient
        self._pending.append((shard, local.reshape(-1)))
        self._pending_unit = unit
        if len(self._pending) == self._unit_size[unit]:
            ready.append(self._take_pending())
        return ready

    def finish(self) -> list[ShardGrads]:
        return [self._take_pending()] if self._pending else []

    def abandon(self) -> None:
        self._take_pending()

    def all_reduce_sum_(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)

    def after_update(self) -> None:
        refresh_unsharded(self.model)

    def gather_slices(self, param: nn.Parameter, values: torch.Tensor) -> torch.Tensor:
        world = dist.get_world_size(self.group)
        rows = param.shape[0] if param.dim() else 1
        row_numel = param.numel() // rows if rows else 0
        chunk = row_range(rows, world, 0)[1] * row_numel
        return gather_padded(values, chunk, param.numel(), self.group)

    def slice_as_dtensor(self, param: nn.Parameter, values: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(
            values.view(param.to_local().shape),
            param.device_mesh,
            param.placements,
            shape=param.shape,
            stride=param.stride(),
            run_check=False,
        )

    def _take_pending(self) -> ShardGrads:
        ready, self._pending, self._pending_unit = self._pending, [], None
        return ready

    def _name(self, param: nn.Parameter) -> str:
        return next((n for n, p in self.model.named_parameters() if p is param), "?")
