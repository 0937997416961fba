"""What an optimizer class keeps per trained parameter in ``optimizer.state``, and the rules
its checkpoint follows for it: how the state starts, how a sharded one is gathered whole,
what makes saved values corrupt, and what a lomo-optim state_dict lacks of it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..distributed import Shard, Sharding

State = dict[str, Any]


def non_finite(values: torch.Tensor) -> str | None:
    """What is wrong with a saved state tensor's values (inf/nan), or None."""
    if not bool(torch.isfinite(values).all()):
        return "holds inf/nan"
    return None


def _kept_whole(sharding: Sharding, param: nn.Parameter, values: State) -> State:
    return values


@dataclass(frozen=True)
class ParameterState:
    """One optimizer class's per-parameter state. The defaults keep none (Lomo).

    `name`: the class whose state this is ("Lomo" or "AdaLomo"; a subclass keeps its
    base's), which a state_dict names. `initial(param, shard)`: a parameter's state at
    construction (`shard`: this rank's slice of it, or None unsharded); None keeps no
    state. `unsharded(sharding, param, values)`: a parameter's state gathered whole, on
    every rank (a collective). `problem(values)`: what is wrong with a saved state
    tensor's values, or None. `lomo_optim_gap`: the warning after loading a lomo-optim
    state_dict, which holds only hyper-parameters, where this state is more than that.
    """

    name: str
    initial: Callable[[nn.Parameter, Shard | None], State] | None = None
    unsharded: Callable[[Sharding, nn.Parameter, State], State] = _kept_whole
    problem: Callable[[torch.Tensor], str | None] = non_finite
    lomo_optim_gap: str | None = None
