"""Both sharding engines provide the `Sharding` protocol the optimizer calls: every member,
with the protocol's parameter names (a method renamed or re-signed on one side fails here).
Their behaviour is checked by the 2-rank runs (test_zero3.py, test_fsdp2.py)."""

from __future__ import annotations

import inspect

import pytest

from lomo_kernels.distributed import Fsdp2Sharding, Sharding, Zero3Sharding

PROTOCOL_METHODS = {
    name: member
    for name, member in vars(Sharding).items()
    if inspect.isfunction(member) and not name.startswith("_")
}


def test_protocol_lists_the_members_the_optimizer_uses():
    assert set(PROTOCOL_METHODS) == {
        "shard",
        "begin",
        "grad_ready",
        "finish",
        "abandon",
        "all_reduce_sum_",
        "after_update",
        "gather_slices",
        "slice_as_dtensor",
    }
    assert "second_backward_ok" in Sharding.__annotations__


@pytest.mark.parametrize("engine", [Zero3Sharding, Fsdp2Sharding], ids=lambda c: c.__name__)
def test_engine_provides_every_member_with_its_parameters(engine):
    assert isinstance(engine.second_backward_ok, bool)
    for name, member in PROTOCOL_METHODS.items():
        own = getattr(engine, name, None)
        assert inspect.isfunction(own), f"{engine.__name__} lacks {name}"
        expected = list(inspect.signature(member).parameters)
        assert list(inspect.signature(own).parameters) == expected, f"{engine.__name__}.{name}"
