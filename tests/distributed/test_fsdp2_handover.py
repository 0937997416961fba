"""How FSDP2's sharding hands the reduced gradient shards to the optimizer
(`distributed/fsdp2.py: Fsdp2Sharding.grad_ready`): one batch per unit, when its last
trainable parameter's shard arrives, or, for a unit some of whose parameters got no gradient
(a layer a micro-batch skipped, a frozen input), when the next unit's first shard arrives or
backward ends. AdaLomo's cross-rank statistics run once per batch, so a unit's shards must
never be held back nor mixed with the next unit's. The batching alone, on stand-in
gradients (the 2-rank runs, test_fsdp2.py, check the values against one process)."""

from __future__ import annotations

import pytest
import torch

from lomo_kernels.distributed import fsdp2
from lomo_kernels.distributed.fsdp2 import Fsdp2Sharding
from lomo_kernels.distributed.shard import Shard


class _LocalGrad:
    """A gradient shard as FSDP2 hands it over: what `to_local()` gives."""

    def __init__(self, values: torch.Tensor) -> None:
        self.values = values

    def to_local(self) -> torch.Tensor:
        return self.values


@pytest.fixture
def units(monkeypatch):
    """Parameters a, b (unit 0), c, d (unit 1), e (unit 2) and their sharding."""
    params = {name: torch.nn.Parameter(torch.zeros(3)) for name in "abcde"}
    sharding = object.__new__(Fsdp2Sharding)  # the batching alone: no model, no group
    units = dict(zip("abcde", (0, 0, 1, 1, 2), strict=True))
    sharding._unit_of = {id(params[n]): unit for n, unit in units.items()}
    sharding._unit_size = {0: 2, 1: 2, 2: 1}
    sharding._pending, sharding._pending_unit = [], None
    monkeypatch.setattr(fsdp2, "is_dtensor", lambda grad: isinstance(grad, _LocalGrad))
    monkeypatch.setattr(
        sharding, "shard", lambda p: Shard(p, p.detach().view(-1), 0, p.shape, None)
    )
    return sharding, params


def _arrive(sharding, params, order: str) -> list[str]:
    """The batches handed over as the named parameters' shards arrive in `order`, then at
    the end of backward, as strings of names."""
    names = {id(p): n for n, p in params.items()}
    batches = []
    for name in order:
        batches += sharding.grad_ready(params[name], _LocalGrad(torch.ones(3)))
    batches += sharding.finish()
    return ["".join(names[id(shard.param)] for shard, _ in batch) for batch in batches]


@pytest.mark.parametrize(
    "order,batches",
    [
        ("abcde", ["ab", "cd", "e"]),  # every parameter: a batch per unit, at its last
        ("acde", ["a", "cd", "e"]),  # b got no gradient: unit 0 handed over as c arrives
        ("abce", ["ab", "c", "e"]),  # d none: unit 1 handed over as e arrives
        ("abc", ["ab", "c"]),  # the last unit incomplete: handed over at the end
        ("abe", ["ab", "e"]),  # unit 1 skipped whole
        ("bade", ["ba", "d", "e"]),  # in any order within a unit; c none
    ],
)
def test_a_unit_is_handed_over_whole_and_alone(units, order, batches):
    sharding, params = units
    assert _arrive(sharding, params, order) == batches
    assert sharding._pending == []  # nothing held after backward
