"""Sharded training: moving gradients and parameters between ranks, nothing else.

`sharding_for` looks at the trainable parameters once, at construction, and returns the
`Sharding` that moves their gradients: `Zero3Sharding` (DeepSpeed ZeRO-3: full local
gradients, reduce-scattered here) or `Fsdp2Sharding` (FSDP2: gradients arrive reduced, one
shard per rank), or None for one process. The optimizer calls it and gets back this rank's
`Shard`s with their reduced gradients, which it updates itself: one update path serves both
engines. Set-ups that would train wrongly (replicated data parallelism, where each rank
would apply its own unreduced gradient) are refused there, before any hook exists.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..core.torch_internals import non_persistent_buffer_names
from .fsdp2 import Fsdp2Sharding, compute_dtype, fsdp_params_of, is_dtensor
from .reduce_scatter import DEFAULT_BUCKET_NUMEL, DEFAULT_MAX_INFLIGHT
from .shard import Shard, ShardGrads
from .sharding import Sharding
from .zero3 import Zero3Sharding, gather_full, is_zero3_param, unwrap_engine

__all__ = [
    "DEFAULT_BUCKET_NUMEL",
    "Fsdp2Sharding",
    "Shard",
    "ShardGrads",
    "Sharding",
    "Zero3Sharding",
    "compute_dtypes",
    "consolidated_state_dict",
    "persistent_buffers",
    "sharding_for",
    "unwrap_engine",
]


def sharding_for(
    params: Sequence[nn.Parameter],
    names: dict[int, str],
    *,
    model: nn.Module | None = None,
    bucket_numel: int = DEFAULT_BUCKET_NUMEL,
    max_inflight: int = DEFAULT_MAX_INFLIGHT,
    replicated: bool = True,
) -> Sharding | None:
    """The sharding engine behind `params`, or None when one process holds them whole.

    `model` (the module owning `params`) is needed to find FSDP2's units. `replicated=False`
    says that each rank's unsharded parameters are its own (pipeline stages, a per-rank
    model): nothing is reduced across ranks, and the multi-rank refusal below does not apply.
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
    if replicated and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(
            f"torch.distributed runs {dist.get_world_size()} ranks but the parameters are "
            "whole on every rank (DDP, ZeRO stage 1/2, or no wrapper): each rank would apply "
            "its own unreduced gradient and the replicas would drift apart. Shard the model "
            "with FSDP2 (fully_shard) or DeepSpeed ZeRO-3 (README, 'Sharded training'), or "
            "run one process; if each rank's parameters are its own (pipeline stages, a model "
            "per rank), pass replicated=False."
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
    for name, b in persistent_buffers(model):
        value = b.detach().full_tensor() if is_dtensor(b) else b.detach()
        state[name] = value.clone()
    return state


def persistent_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, buffer) for each buffer in `model`'s ``state_dict()``, under each of its names
    (the persistent ones)."""
    for prefix, module in model.named_modules(remove_duplicate=False):
        skipped = non_persistent_buffer_names(module)
        for name, b in module.named_buffers(recurse=False):
            if b is not None and name not in skipped:
                yield f"{prefix}.{name}" if prefix else name, b
