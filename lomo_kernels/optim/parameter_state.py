"""What an optimizer class keeps per trained parameter in ``optimizer.state``, and the rules
its checkpoint follows for it: how the state starts, how a sharded one is gathered whole,
what makes saved values corrupt, and what a lomo-optim state_dict lacks of it."""

from __future__ import annotations

from collections import defaultdict
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


@dataclass(frozen=True)
class ParameterState:
    """One optimizer class's per-parameter state. The defaults keep none (Lomo).

    `name`: the class whose state this is ("Lomo" or "AdaLomo"; a subclass keeps its
    base's), which a state_dict names. `initial(param, shard)`: a parameter's state at
    construction (`shard`: this rank's slice of it, or None unsharded); None keeps no
    state. `sliced`: the keys whose tensors hold, when sharded, this rank's slice of a
    tensor shaped like the flat parameter (the others are whole on every rank).
    `problem(values)`: what is wrong with a saved state
    tensor's values, or None. `lomo_optim_gap`: the warning after loading a lomo-optim
    state_dict, which holds only hyper-parameters, where this state is more than that.
    """

    name: str
    initial: Callable[[nn.Parameter, Shard | None], State] | None = None
    sliced: frozenset[str] = frozenset()
    problem: Callable[[torch.Tensor], str | None] = non_finite
    lomo_optim_gap: str | None = None

    def unsharded(self, sharding: Sharding, param: nn.Parameter, values: State) -> State:
        """`values` with every sliced tensor gathered whole, on every rank (a collective)."""
        return {
            k: sharding.gather_slices(param, v) if k in self.sliced else v
            for k, v in values.items()
        }

    def as_dtensors(self, sharding: Sharding, param: nn.Parameter, values: State) -> State:
        """`values` with every sliced tensor as the DTensor of its slice (the form
        torch.distributed.checkpoint saves per rank and reshards)."""
        return {
            k: sharding.slice_as_dtensor(param, v) if k in self.sliced else v
            for k, v in values.items()
        }

    def fresh_container(self) -> defaultdict:
        """An empty ``optimizer.state`` for this class (`StatelessState` when it keeps none)."""
        return defaultdict(dict) if self.initial is not None else StatelessState(dict)


class StatelessState(defaultdict):
    """``optimizer.state`` of an optimizer that keeps nothing per parameter (Lomo): it counts
    as initialised. torch.distributed.checkpoint's get/set_state_dict initialise an empty
    state by setting a zero gradient on every trainable parameter and stepping
    (``_init_optim_state``): a whole model's gradients at once, the memory LOMO exists to
    avoid."""

    def __bool__(self) -> bool:
        return True
