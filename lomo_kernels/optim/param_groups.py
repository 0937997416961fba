"""torch-style param groups for optimizers built from a model.

``Lomo(model, ..., param_groups=[{"params": [...], "weight_decay": 0.0}, ...])`` gives some
parameters their own hyper-parameters (transformers' Trainer keeps weight decay off norm
weights and biases this way). The optimizer still takes the model: it hooks every trainable
parameter, so the groups only say which values each one uses.

Rules, checked before any hook is attached:

- a group is a dict with "params" (a list of parameters of the model, or their names as in
  ``model.named_parameters()``) and any of the optimizer's hyper-parameters; a value a group
  does not set is the constructor's;
- every parameter listed is a trainable parameter of the model, in one group only (a tied
  parameter listed under two names in one group counts once);
- the trainable parameters no group lists form one more group, last, with the
  constructor's values;
- clip_grad_norm is one value for all groups (clipping by the global norm has one threshold).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ._hyper import checked_group


def build_param_groups(
    model: nn.Module,
    params: list[nn.Parameter],
    param_groups: Sequence[Mapping[str, Any]] | None,
    defaults: Mapping[str, Any],
) -> list[dict[str, Any]]:
    """The optimizer's groups: `param_groups` resolved against the model's trainable
    `params` (in their order within each group), the unlisted ones in a last group with the
    `defaults`. Without `param_groups`, one group of every trainable parameter."""
    if param_groups is None:
        return [{"params": params}]
    if isinstance(param_groups, Mapping) or not isinstance(param_groups, Sequence):
        raise TypeError(
            "param_groups must be a list of dicts, each with 'params' (parameters or their "
            f"names) and the hyper-parameters to override, got {type(param_groups).__name__}"
        )
    by_name = dict(model.named_parameters(remove_duplicate=False))
    trainable = {id(p) for p in params}
    group_of: dict[int, int] = {}
    groups = []
    for index, group in enumerate(param_groups):
        where = f"param_groups[{index}]"
        listed = _listed(group, where, by_name)
        overrides = _overrides(group, where, defaults)
        members: dict[int, nn.Parameter] = {}
        for name, p in listed:
            if id(p) not in trainable:
                raise ValueError(
                    f"{where} lists {name}, which is not a trainable parameter of the model "
                    "(frozen, or of another model): list only parameters with "
                    "requires_grad=True of the model given to the optimizer"
                )
            first = group_of.setdefault(id(p), index)
            if first != index:
                raise ValueError(
                    f"{where} lists {name}, already in param_groups[{first}]: a parameter "
                    "belongs to one group only"
                )
            members[id(p)] = p
        groups.append({**overrides, "params": list(members.values())})
    rest = [p for p in params if id(p) not in group_of]
    if rest:
        groups.append({"params": rest})
    return groups


def _listed(
    group: Any, where: str, by_name: dict[str, nn.Parameter]
) -> list[tuple[str, nn.Parameter]]:
    """A group's parameters with how to name them in an error."""
    if not isinstance(group, Mapping) or "params" not in group:
        raise TypeError(f"{where} must be a dict with a 'params' list, got {group!r:.80}")
    items = group["params"]
    if isinstance(items, (torch.Tensor, str)) or not isinstance(items, Sequence):
        raise TypeError(
            f"{where}['params'] must be a list of parameters or parameter names, got "
            f"{type(items).__name__}"
        )
    names = {id(p): n for n, p in by_name.items()}
    listed = []
    for item in items:
        if isinstance(item, str):
            if item not in by_name:
                raise ValueError(f"{where} lists {item!r}, which is no parameter name of the model")
            listed.append((repr(item), by_name[item]))
        elif isinstance(item, torch.Tensor):
            name = names.get(id(item))
            shown = repr(name) if name else f"a tensor of shape {tuple(item.shape)}"
            listed.append((shown, item))
        else:
            raise TypeError(
                f"{where}['params'] holds a {type(item).__name__}: list parameters or their names"
            )
    return listed


def _overrides(group: Mapping[str, Any], where: str, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """A group's hyper-parameters, checked; a key the optimizer does not have is refused."""
    unknown = set(group) - {"params"} - set(defaults)
    if unknown:
        raise ValueError(
            f"{where} sets {sorted(unknown)}, which this optimizer does not have; a group may "
            f"set {sorted(defaults)}"
        )
    return checked_group(group, where)
