"""What a Lomo/AdaLomo constructor takes as its first argument: lomo-optim's model, or what a
torch optimizer takes.

    Lomo(model, lr=1e-3)                                   # lomo-optim's form
    Lomo(model.parameters(), lr=1e-3)                      # torch's: an iterable of tensors
    Lomo(model.named_parameters(), lr=1e-3)                # (name, tensor) pairs
    Lomo([{"params": decay, "weight_decay": 0.01},         # torch's param-group dicts
          {"params": no_decay, "weight_decay": 0.0}], lr=1e-3)

Given parameters instead of a model, the optimizer works on a `GivenParameters` module that
holds them under their names (those of ``named_parameters()`` pairs, else ``param_<i>``, i
counting every tensor given, in order): every check and message of the model form applies
and names them so. As with a model, frozen tensors (``requires_grad=False``) are left alone
and a tensor listed twice counts once (in two groups it is refused). Param-group dicts become
the optimizer's ``param_groups`` with their own values, as torch's optimizers take them;
``param_groups=`` is then refused (the groups are given once).

What only a model shows is not known from a list: FSDP2's units (DTensor parameters are
refused: pass the model), and modules (an ``nn.Embedding`` set to ``sparse=True`` is refused
when its sparse gradient reaches the hook, or by the graph read before an update pass).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..distributed import is_dtensor

ARGUMENT_FORMS = (
    "a model (nn.Module), an iterable of parameters (model.parameters()), of (name, "
    "parameter) pairs (model.named_parameters()), or of param-group dicts, each with "
    "'params' and the values to override"
)


class GivenParameters(nn.Module):
    """The tensors an optimizer was given without a model, under their names (which may hold
    dots, as ``named_parameters()`` gives them). Nothing is registered: its parameters are
    exactly the given tensors, in order."""

    def __init__(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        super().__init__()
        self._given = tuple(named)

    def named_parameters(  # type: ignore[override]
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterable[tuple[str, torch.Tensor]]:
        seen: set[int] = set()
        for name, p in self._given:
            if remove_duplicate:
                if id(p) in seen:
                    continue
                seen.add(id(p))
            yield prefix + name, p

    def parameters(self, recurse: bool = True) -> Iterable[torch.Tensor]:  # type: ignore[override]
        for _, p in self.named_parameters():
            yield p

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            "this optimizer was given parameters, not a model: call your model, then "
            "opt.fused_backward(loss)"
        )


def model_and_groups(
    source: Any, param_groups: Sequence[Mapping[str, Any]] | None
) -> tuple[nn.Module, Sequence[Mapping[str, Any]] | None]:
    """(the model to hook, the param groups) for a constructor's first argument and its
    ``param_groups=``: a model as given, anything else through `GivenParameters`."""
    if isinstance(source, nn.Module):
        return source, param_groups
    if isinstance(source, torch.Tensor):
        raise TypeError(f"the optimizer takes {ARGUMENT_FORMS}; got one tensor: pass [tensor]")
    if isinstance(source, (str, bytes, Mapping)) or not isinstance(source, Iterable):
        raise TypeError(f"the optimizer takes {ARGUMENT_FORMS}; got {type(source).__name__}")
    items = list(source)
    if not items:
        raise ValueError("the optimizer got an empty parameter list: nothing to update")
    dicts = [isinstance(item, Mapping) for item in items]
    if any(dicts) and not all(dicts):
        raise TypeError(
            "the optimizer got param-group dicts mixed with tensors: give either every "
            "parameter as a tensor or every group as a dict with 'params'"
        )
    if all(dicts):
        if param_groups is not None:
            raise TypeError(
                "param-group dicts given twice (as the first argument and as param_groups=): "
                "give them once"
            )
        return _from_groups(items)
    named: list[tuple[str, torch.Tensor]] = []
    _add(items, "the parameter list", named)
    return GivenParameters(named), param_groups


def _from_groups(groups: list[Mapping[str, Any]]) -> tuple[nn.Module, list[dict[str, Any]]]:
    named: list[tuple[str, torch.Tensor]] = []
    resolved = []
    for index, group in enumerate(groups):
        where = f"param group {index}"
        if "params" not in group:
            raise TypeError(f"{where} has no 'params': each group is a dict with 'params'")
        members = group["params"]
        if isinstance(members, torch.Tensor):
            members = [members]  # as torch's optimizers take one
        elif isinstance(members, (str, bytes, Mapping)) or not isinstance(members, Iterable):
            raise TypeError(
                f"{where}['params'] must be parameters or (name, parameter) pairs, got "
                f"{type(members).__name__}"
            )
        members = list(members)
        given_names = group.get("param_names")  # torch's optimizers accept these too
        if given_names is not None:
            given_names = list(given_names)
            if len(given_names) != len(members) or not all(isinstance(n, str) for n in given_names):
                raise ValueError(
                    f"{where}['param_names'] must name each of its {len(members)} parameters"
                )
            members = list(zip(given_names, members, strict=True))
        start = len(named)
        _add(members, where, named)
        # Frozen tensors are left alone, as in the model form (a model's frozen parameters
        # carry no hook); the group keeps its trainable ones.
        params = [p for _, p in named[start:] if p.requires_grad]
        values = {k: v for k, v in group.items() if k != "param_names"}
        resolved.append({**values, "params": params})
    return GivenParameters(named), resolved


def _add(items: list[Any], where: str, named: list[tuple[str, torch.Tensor]]) -> None:
    """Appends `items` (tensors or (name, tensor) pairs) to `named`, checking each."""
    for item in items:
        index = len(named)
        if (
            isinstance(item, tuple)
            and len(item) == 2
            and isinstance(item[0], str)
            and isinstance(item[1], torch.Tensor)
        ):
            name, tensor = item
        elif isinstance(item, torch.Tensor):
            name, tensor = f"param_{index}", item
        else:
            raise TypeError(
                f"{where} holds a {type(item).__name__} at position {index}: give parameters "
                "(tensors) or (name, parameter) pairs"
            )
        if tensor.requires_grad and not tensor.is_leaf:
            raise ValueError(
                f"parameter {name!r} is not a leaf tensor (it is computed from others), so no "
                "gradient is accumulated into it for the optimizer's hook: give the leaf "
                "tensors (nn.Parameter) the model trains"
            )
        if is_dtensor(tensor):
            raise ValueError(
                f"parameter {name!r} is a DTensor (FSDP2): pass the model, whose fully_shard "
                "units the optimizer follows"
            )
        named.append((name, tensor))
