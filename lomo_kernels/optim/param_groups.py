"""The optimizer's param groups: how they are formed from the model, what the hooks read of
them, lomo-optim's attribute names for their values, and a saved copy's match with them.
The values themselves are checked by the rules in `_hyper.py`.

``Lomo(model, ..., param_groups=[{"params": [...], "weight_decay": 0.0}, ...])`` gives some
parameters their own hyper-parameters (transformers' Trainer keeps weight decay off norm
weights and biases this way). The optimizer still takes the model (or the parameters,
`given_parameters.py`): it hooks every trainable parameter, so the groups only say which
values each one uses.

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

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ._hyper import CHECKS, checked_group, checked_groups


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


def group_index(groups: list[dict[str, Any]]) -> dict[int, int]:
    """id(parameter) -> the index of its group."""
    return {id(p): i for i, g in enumerate(groups) for p in g["params"]}


def current_group_index(
    groups: list[dict[str, Any]], hooked: Mapping[int, Any], names: Callable[[], dict[int, str]]
) -> dict[int, int]:
    """`group_index` of the groups as they are now, after checking that they list exactly
    the `hooked` parameters (ids), each once. A parameter may move to another group between
    steps (the hooks read this index); one added to the groups has no hook, and one left out
    of every group has no values. `names()`: the model's parameter names, for the error."""
    index: dict[int, int] = {}
    for i, group in enumerate(groups):
        for p in group["params"]:
            if id(p) in hooked and id(p) not in index:
                index[id(p)] = i
                continue
            name = names().get(id(p))
            shown = repr(name) if name else f"{type(p).__name__} {p!r:.40}"
            if isinstance(p, torch.Tensor) and not name:
                shown = f"a tensor of shape {tuple(p.shape)}"
            if id(p) in index:
                raise ValueError(
                    f"param_groups[{i}] lists {shown}, already in param_groups[{index[id(p)]}]: "
                    "a parameter belongs to one group only; nothing was changed"
                )
            raise ValueError(
                f"param_groups[{i}] lists {shown}, which the optimizer has no hook on (a group "
                "added with add_param_group, or a parameter appended to a group): it steps the "
                "trainable parameters of the model it was built with; nothing was changed. "
                "Build a new optimizer with param_groups=[...] to train other parameters"
            )
    if len(index) != len(hooked):
        name = next(n for i, n in names().items() if i in hooked and i not in index)
        raise ValueError(
            f"parameter {name!r} is in no param group (a group or a parameter was removed from "
            "param_groups): every trainable parameter stays in one group; move it to another "
            "group instead (or freeze it and build a new optimizer); nothing was changed"
        )
    return index


def hook_groups(checked: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Checked group hyper-parameters without lr, as plain dicts for the hooks.

    torch.compile guards on every value of an optimizer's param_groups, so reading the
    groups inside a traced hook would recompile the backward whenever the lr changes (the
    hooks take the lr from a device tensor per group).
    """
    return [{k: v for k, v in group.items() if k != "lr"} for group in checked]


class HookGroups:
    """What the hooks read of the param groups, refreshed from them before each step: each
    trained parameter's index (`index_of`) and group (`group_of`), the groups'
    hyper-parameters without lr (`hyper`) and the clip threshold (`max_norm`)."""

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        index_of: dict[int, int],
        defaults: Mapping[str, Any],
    ) -> None:
        """`index_of`: each trained parameter's index (the optimizer's claim on them,
        `core/ownership.py`); `defaults`: the optimizer's checked hyper-parameters (every
        group keeps each of them)."""
        self._required = [key for key in defaults if key in CHECKS]  # not torch.optim's own
        self.index_of = index_of
        self.group_of = group_index(param_groups)
        self.hyper = hook_groups(self.checked(param_groups))
        # The step's clip threshold: traced code reads this float, not param_groups (whose
        # lr changes every step: a guard on the group would recompile a compiled step).
        self.max_norm: float | None = defaults["clip_grad_norm"]

    def checked(
        self, param_groups: list[dict[str, Any]], lr: float | None = None
    ) -> list[dict[str, Any]]:
        """The groups' hyper-parameters, checked (with `lr` in place of theirs when given)."""
        return checked_groups(param_groups, "param_groups", lr, required=self._required)

    def refresh(
        self,
        param_groups: list[dict[str, Any]],
        checked: list[dict[str, Any]],
        names: Callable[[], dict[int, str]],
    ) -> None:
        """Takes the groups as they are now (`checked`: their checked values), after
        refusing a change of which parameters they list. `names()`: the model's parameter
        names, for errors."""
        # A parameter may have moved to another group: the hooks read this index.
        self.group_of = current_group_index(param_groups, self.index_of, names)
        self.hyper = hook_groups(checked)
        self.max_norm = checked[0]["clip_grad_norm"]

    def of(self, param: torch.Tensor) -> tuple[int, dict[str, Any]]:
        """(`param`'s group index, that group's hyper-parameters without lr)."""
        index = self.group_of[id(param)]
        return index, self.hyper[index]


class GroupHyperParameter:
    """An optimizer attribute that reads the first param group's value of `name` and, when
    assigned, checks the value and sets it in every group (lomo-optim keeps these as
    attributes; here they live in param_groups, where schedulers and state_dict see them)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, optimizer: Any, owner: type | None = None) -> Any:
        if optimizer is None:
            return self
        return optimizer.param_groups[0][self.name]

    def __set__(self, optimizer: Any, value: Any) -> None:
        value = CHECKS[self.name](value)
        for group in optimizer.param_groups:
            group[self.name] = value


def check_saved_groups(groups: Any, own: list[dict[str, Any]]) -> None:
    """Refuses saved param groups that do not match `own` (count, parameters per group,
    hyper-parameter keys) or whose values break the rules."""
    if not isinstance(groups, list) or len(groups) != len(own):
        count = len(groups) if isinstance(groups, list) else "no list of"
        raise ValueError(
            f"state_dict has {count} param groups, this optimizer {len(own)}: the "
            "checkpoint belongs to another optimizer set-up"
        )
    for i, (saved, group) in enumerate(zip(groups, own, strict=True)):
        saved_params = saved.get("params", ()) if isinstance(saved, dict) else ()
        if len(saved_params) != len(group["params"]):
            raise ValueError(
                f"state_dict['param_groups'][{i}] holds {len(saved_params)} parameters, this "
                f"optimizer's {len(group['params'])}: the checkpoint belongs to another model "
                "(or to other frozen parameters)"
            )
        differing = {k for k in group if k in CHECKS} ^ {k for k in saved if k in CHECKS}
        if differing:
            raise ValueError(
                f"state_dict['param_groups'][{i}] differs from this optimizer's in the "
                f"hyper-parameters {sorted(differing)}: it was written by another optimizer "
                "class"
            )
    checked_groups(groups, "state_dict['param_groups']")
