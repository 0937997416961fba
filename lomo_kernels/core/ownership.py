"""The one record of which parameters a live in-backward optimizer updates, and at which index.

An optimizer builds its `Claim` on its trained parameters first (their index), holds it when
it attaches its hooks (`Claim.hold`) and gives it back when it is detached or collected
(`Claim.release`). Everything that asks "does an
optimizer update this tensor in backward, which one, and what is its index there" reads this
record: the optimizer itself (its norm slots and rounding seeds are the index), a second
optimizer refusing the same parameters, compiled autograd's capture (`compile/scope.py`), and
a fused op handing a gradient over in row blocks (`optim/row_blocks.py`). It holds neither the
parameters nor the optimizers strongly.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch


class Claim:
    """One optimizer's parameters: their index among its trained parameters (`index_of`),
    and the optimizer, weakly (the record must not keep it alive)."""

    def __init__(self, optimizer: Any, params: Sequence[torch.Tensor]) -> None:
        self.owner = type(optimizer).__name__
        self.optimizer = weakref.ref(optimizer)
        self.index_of = {id(p): i for i, p in enumerate(params)}
        self._params = list(params)  # until `hold`; the record keeps them weakly

    def updates(self, t: Any) -> bool:
        """Whether `t` is one of this claim's parameters and the claim is still held."""
        return claim_of(t) is self

    def hold(self) -> None:
        """Records the parameters as this claim's (the constructor refused any a live
        optimizer holds, `refuse_claimed`, before building anything)."""
        params, self._params = self._params, []
        for p in params:
            _CLAIMS[id(p)] = (weakref.ref(p), self)

    def release(self) -> None:
        """Gives the parameters back (detach, or the optimizer's collection)."""
        for i in self.index_of:
            entry = _CLAIMS.get(i)
            if entry is not None and entry[1] is self:
                del _CLAIMS[i]


# id(parameter) -> (the parameter, weakly; the claim holding it)
_CLAIMS: dict[int, tuple[weakref.ref[torch.Tensor], Claim]] = {}


def refuse_claimed(params: Sequence[torch.Tensor], names: dict[int, str], new_owner: str) -> None:
    """Refuses parameters that a live optimizer already updates in backward: both would step
    them in the same backward. `names`: the parameters' names; `new_owner`: the class asking."""
    for p in params:
        record = claim_of(p)
        if record is not None:
            raise ValueError(
                f"parameter {names.get(id(p), '?')!r} is already updated in backward by a live "
                f"{record.owner}: call .detach() on that optimizer (or build it in a with "
                f"block) before building a {new_owner} on the same parameters"
            )


def claim_of(t: Any) -> Claim | None:
    """The claim holding parameter `t`, or None."""
    entry = _CLAIMS.get(id(t))
    return entry[1] if entry is not None and entry[0]() is t else None


def updated_in_backward(t: Any) -> bool:
    """Whether `t` is a parameter that a live in-backward optimizer updates in its hooks."""
    return claim_of(t) is not None


def owner_of(t: Any) -> Any:
    """The live in-backward optimizer that updates parameter `t`, or None."""
    record = claim_of(t)
    return None if record is None else record.optimizer()
