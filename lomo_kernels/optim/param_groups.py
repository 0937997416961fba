"""The optimizer's param groups: how they are formed from the model, what the hooks read of
them, lomo-optim's attribute names for their values, and a saved copy's match with them.

The values themselves are checked by the rules in `_hyper.py`.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ._hyper import CHECKS, checked_groups


def initial_param_groups(params: list[nn.Parameter]) -> list[dict[str, Any]]:
    """The groups a new optimizer starts with: every trainable parameter in one group, as
    lomo-optim (the constructor's defaults fill in the hyper-parameters)."""
    return [{"params": params}]


def group_index(groups: list[dict[str, Any]]) -> dict[int, int]:
    """id(parameter) -> the index of its group."""
    return {id(p): i for i, g in enumerate(groups) for p in g["params"]}


def hook_groups(checked: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Checked group hyper-parameters without lr, as plain dicts for the hooks.

    torch.compile guards on every value of an optimizer's param_groups, so reading the
    groups inside a traced hook would recompile the backward whenever the lr changes (the
    hooks take the lr from a device tensor per group).
    """
    return [{k: v for k, v in group.items() if k != "lr"} for group in checked]


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
