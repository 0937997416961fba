"""What a sharded checkpoint holds, in the form torch.distributed.checkpoint saves per rank
and reshards on load: the model's parameters and persistent buffers, and the optimizer's
state_dict keyed by parameter name.

FSDP2 and one process go through torch's own ``get_model_state_dict`` /
``get_optimizer_state_dict``: a checkpoint of one loads into the other at any world size.
Under DeepSpeed ZeRO-3 a parameter is saved as the flat DTensor of its partitions (ZeRO-3
partitions the flattened tensor), so it resumes under ZeRO-3 at any world size, and in one
process (into flat views of the parameters); not under FSDP2, whose shards are rows.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..distributed import persistent_buffers
from ..distributed.fsdp2 import refresh_unsharded
from ..distributed.zero3 import (
    flat_dtensor,
    is_zero3_param,
    refresh_gathered,
    unwrap_engine,
    zero3_shard,
)
from .manifest import CheckpointError

MODEL = "model"
OPTIMIZER = "optimizer"


def is_zero3(model: nn.Module) -> bool:
    return any(is_zero3_param(p) for p in unwrap_engine(model).parameters())


def model_state(model: nn.Module, *, frozen: bool = True) -> dict[str, torch.Tensor]:
    """This rank's part of the model's parameters and persistent buffers, sharing their
    storage: a checkpoint loaded into it is loaded into the model. `frozen=False` leaves out
    parameters that do not require a gradient."""
    module = unwrap_engine(model)
    if not is_zero3(module):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        named = module.named_parameters()
        left_out = set() if frozen else {n for n, p in named if not p.requires_grad}
        return {k: v for k, v in get_model_state_dict(module).items() if k not in left_out}
    state: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters():
        if not (frozen or p.requires_grad):
            continue
        if is_zero3_param(p):
            shard = zero3_shard(p)
            state[name] = flat_dtensor(shard, shard.local)
        else:
            state[name] = p.detach()
    for name, buffer in persistent_buffers(module):
        state[name] = buffer.detach()
    return state


def flat_where_saved_flat(state: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
    """`state` (a model's, by name) with each whole, contiguous tensor that the checkpoint
    holds flat (ZeRO-3 saves its parameters so) replaced by a flat view of it: a ZeRO-3
    checkpoint loads into the model in one process."""
    adapted = dict(state)
    for name, tensor in state.items():
        size = getattr(saved.get(f"{MODEL}.{name}"), "size", None)
        if (
            size is not None
            and tuple(size) == (tensor.numel(),)
            and tensor.dim() != 1
            and type(tensor) is torch.Tensor
            and tensor.is_contiguous()
        ):
            adapted[name] = tensor.view(-1)
    return adapted


def without_unsaved_aliases(state: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
    """`state` (a model's, by name) without the names the checkpoint does not hold of a
    tensor it holds under another name: a tied weight, which ZeRO-3 saves once, under the
    Parameter's first name, and torch's state dict holds under each of its names."""

    def memory(tensor: Any) -> tuple[int, int] | None:
        # A meta tensor has no memory to share (its data_ptr is 0).
        if type(tensor) is not torch.Tensor or not tensor.numel() or tensor.is_meta:
            return None
        return tensor.data_ptr(), tensor.numel()

    held = {memory(t) for name, t in state.items() if f"{MODEL}.{name}" in saved} - {None}
    return {
        name: tensor
        for name, tensor in state.items()
        if f"{MODEL}.{name}" in saved or memory(tensor) not in held
    }


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state_dict keyed by parameter name (its tensors are copies: loading
    into them changes nothing until `apply_optimizer_state`)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    module = unwrap_engine(model)
    owned = {id(p) for p in module.parameters()}
    if any(id(p) not in owned for g in optimizer.param_groups for p in g["params"]):
        raise ValueError(
            f"the {type(optimizer).__name__} trains parameters that are not the model's: pass "
            "the model the optimizer was built on"
        )
    return get_optimizer_state_dict(module, optimizer)


# A param group's entries that make the optimizer what it is: its hyper-parameters (its
# defaults' keys) and these. Any other (a scheduler's 'initial_lr', a key of the user's) is
# taken as the checkpoint holds it, as torch's load_state_dict takes a group's keys; so are
# the entries an optimizer names optional (`optional_group_entries`: dotted paths).
_GROUP_STRUCTURE = ("params", "param_names", "lomo")


def with_saved_group_extras(
    state: dict[str, Any], saved: dict[str, Any], optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """`state` (`optimizer_state`'s) with each param group's extra and optional entries (see
    `_GROUP_STRUCTURE`) as the checkpoint's (`saved`: its metadata) group holds them: loaded
    where it holds one (into a placeholder where this run has none), left out where it does
    not (the optimizer's load then goes without it, as its load_state_dict would)."""
    own = {*optimizer.defaults, *_GROUP_STRUCTURE}
    optional = tuple(getattr(optimizer, "optional_group_entries", ()))

    def decided_by_checkpoint(key: str) -> bool:
        return key.split(".", 1)[0] not in own or any(
            key == path or key.startswith(f"{path}.") for path in optional
        )

    groups = []
    for index, group in enumerate(state["param_groups"]):
        prefix = f"{OPTIMIZER}.param_groups.{index}."
        held = {key[len(prefix) :] for key in saved if key.startswith(prefix)}
        group = copy.deepcopy(group)
        for key, _ in list(flat_entries(group)):
            if decided_by_checkpoint(key) and key not in held:
                _set_entry(group, key, remove=True)
        for key in held:
            if decided_by_checkpoint(key):
                _set_entry(group, key)
        groups.append(group)
    return {**state, "param_groups": groups}


def _set_entry(tree: dict[str, Any], key: str, remove: bool = False) -> None:
    """Places a placeholder (None, which the load replaces) at dotted `key` of nested dicts
    `tree` where it has no entry, making the dicts on its way; or removes the entry, and a
    dict the removal leaves empty."""
    name, _, rest = key.partition(".")
    if not rest:
        if remove:
            tree.pop(name, None)
        else:
            tree.setdefault(name, None)
        return
    below = tree.setdefault(name, {})
    _set_entry(below, rest, remove)
    if remove and not below:
        del tree[name]


def apply_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Loads a name-keyed optimizer state_dict; the optimizer checks all of it first."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(unwrap_engine(model), optimizer, state)


def after_model_load(model: nn.Module) -> None:
    """Brings the engine's gathered copies up to date with the loaded shards."""
    module = unwrap_engine(model)
    if is_zero3(module):
        refresh_gathered([p for p in module.parameters() if is_zero3_param(p)])
    else:
        refresh_unsharded(module)


def _terminal(value: Any) -> bool:
    # A value torch.distributed.checkpoint stores whole: not a dict, and not a list holding
    # a tensor, a dict or such a list.
    if isinstance(value, dict):
        return False
    if not isinstance(value, list):
        return True
    return not any(
        isinstance(v, torch.Tensor) or (isinstance(v, (dict, list)) and not _terminal(v))
        for v in value
    )


def flat_entries(state: Any, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, Any]]:
    """(key, value) for every value torch.distributed.checkpoint stores of a nested state,
    keyed as it flattens them (the path joined by dots)."""
    if _terminal(state):
        yield ".".join(prefix), state
    elif isinstance(state, dict):
        for key, value in state.items():
            yield from flat_entries(value, (*prefix, str(key)))
    else:
        for index, value in enumerate(state):
            yield from flat_entries(value, (*prefix, str(index)))


_WHOLE_INTO_ZERO3 = (
    " (this ZeRO-3 run holds its parameters flat, the checkpoint whole, as one process and "
    "FSDP2 save them: a ZeRO-3 run resumes from a ZeRO-3 checkpoint only; load this one in "
    "one process or under FSDP2, or start ZeRO-3 from its weights, loaded into the model "
    "before deepspeed.initialize)"
)


def _whole_into_flat(saved_shape: tuple[int, ...], value: torch.Tensor) -> bool:
    """Whether a tensor saved whole meets this run's flat ZeRO-3 partitioned one."""
    return len(saved_shape) > 1 and value.dim() == 1 and math.prod(saved_shape) == value.numel()


def check_against_metadata(
    state: dict[str, Any], saved: dict[str, Any], *, strict_model: bool = True
) -> None:
    """Refuses a checkpoint whose entries are not the ones `state` loads: one missing, a
    tensor of another shape, or one this run lacks (for the model only when
    `strict_model`). `saved`: the checkpoint's ``Metadata.state_dict_metadata``."""
    wanted = dict(flat_entries(state))
    for key, value in wanted.items():
        if key not in saved:
            raise CheckpointError(
                f"the checkpoint holds no {key!r}: it was written for another model, optimizer "
                "class or param-group set-up (or with frozen parameters left out)"
            )
        size = getattr(saved[key], "size", None)
        if not isinstance(value, torch.Tensor):
            continue
        if size is None:  # loaded in place of the tensor, not into it
            raise CheckpointError(
                f"the checkpoint's {key!r} is not a tensor: it was written for another "
                "model, optimizer class or param-group set-up"
            )
        if tuple(size) != tuple(value.shape):
            raise CheckpointError(
                f"the checkpoint's {key!r} has shape {tuple(size)}, this run's "
                f"{tuple(value.shape)}: it was written for another model or sharding engine"
                + (_WHOLE_INTO_ZERO3 if _whole_into_flat(tuple(size), value) else "")
            )
    kinds = {MODEL: strict_model, OPTIMIZER: OPTIMIZER in state}  # a model-only load
    for key in saved:
        part = key.split(".", 1)[0]
        if kinds.get(part) and key not in wanted:
            what = "parameter or buffer" if part == MODEL else "optimizer entry"
            raise CheckpointError(
                f"the checkpoint holds the {what} {key!r}, which this run does not have: it "
                "was written for another model, optimizer class or param-group set-up"
            )
