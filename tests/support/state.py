"""Model and optimizer state captured and compared bit for bit (a refused or skipped step
must leave every tensor as it was)."""

from __future__ import annotations

import pytest
import torch


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of `t`: equal only where every element has the same bit pattern."""
    return t.contiguous().view(torch.uint8)


def snapshot(model: torch.nn.Module) -> list[torch.Tensor]:
    """Copies of the model's parameters."""
    return [p.detach().clone() for p in model.parameters()]


def unchanged(model: torch.nn.Module, snap: list[torch.Tensor]) -> bool:
    """Whether every parameter still has the bits of its `snapshot`."""
    return all(torch.equal(bits(p), bits(s)) for p, s in zip(model.parameters(), snap, strict=True))


def tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter and optimizer state tensor (moments, loss scale), cloned."""
    found = snapshot(model)
    for state in opt.state.values():
        found += [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]
    scaler = getattr(opt, "loss_scaler", None)
    if scaler is not None:
        found += [scaler.scale.clone(), scaler.cur_iter.clone()]
    return found


def same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Same count, dtypes and bit patterns, tensor by tensor."""
    return len(a) == len(b) and all(
        x.dtype == y.dtype and torch.equal(bits(x), bits(y)) for x, y in zip(a, b, strict=True)
    )


def assert_refused(model, opt, call, error: type[BaseException], match: str) -> None:
    """`call()` raises `error` (message matching `match`) and changes no tensor."""
    before = tensors(model, opt)
    with pytest.raises(error, match=match):
        call()
    assert same_bits(before, tensors(model, opt))


def assert_same_state(a, b, path: str = "state") -> None:
    """Nested states (tensors, dicts, lists, plain values) equal bit for bit, naming the
    first entry that differs."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{path}: {type(b).__name__}, not a tensor"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{tuple(a.shape)}"
        assert torch.equal(bits(a), bits(b)), f"{path}: differs by {(a - b).abs().max():.3g}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{path}: keys differ"
        for key in a:
            assert_same_state(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{path}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_state(x, y, f"{path}.{i}")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"
