"""Model and optimizer state captured and compared bit for bit (a refused or skipped step
must leave every tensor as it was).

`optimizer_snapshot` is the one definition of what a refusal must leave as it was.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

import pytest
import torch
import torch.distributed as dist


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of `t`: equal only where every element has the same bit pattern (a NaN
    equals the same NaN, unlike with torch.equal); a DTensor's local part."""
    if _is_dtensor(t):
        t = t.to_local()
    return t.contiguous().reshape(-1).view(torch.uint8)


def _is_dtensor(t: Any) -> bool:
    return type(t).__name__ == "DTensor"


def owned(p: torch.Tensor) -> torch.Tensor:
    """The elements of parameter `p` this rank holds, without padding: a ZeRO-3 partition's
    owned part (DeepSpeed allocates partitions with torch.empty and copies only the real
    elements in, so the padding holds arbitrary bits, NaNs included), an FSDP2 DTensor's
    local rows, else `p` itself."""
    partition = getattr(p, "ds_tensor", None)
    if partition is not None:
        size, numel = int(partition.ds_numel), int(p.ds_numel)  # per-rank (padded), whole
        start = min(dist.get_rank(p.ds_process_group) * size, numel)
        return partition.detach().view(-1)[: min(size, numel - start)]
    return p.to_local().detach() if _is_dtensor(p) else p.detach()


def snapshot(model: torch.nn.Module) -> list[torch.Tensor]:
    """Copies of the model's parameters (this rank's owned elements where sharded)."""
    return [owned(p).clone() for p in model.parameters()]


def unchanged(model: torch.nn.Module, snap: list[torch.Tensor]) -> bool:
    """Whether every parameter still has the bits of its `snapshot`."""
    return all(
        torch.equal(bits(owned(p)), bits(s)) for p, s in zip(model.parameters(), snap, strict=True)
    )


def assert_step_moves(model, step, frozen=()) -> None:
    """`step()` changes every trainable parameter of `model` but those named in `frozen`
    (a refusal, or a step that skipped its update, would leave them all as they were)."""
    before = dict(zip((n for n, _ in model.named_parameters()), snapshot(model), strict=True))
    step()
    moved = {n for n, p in model.named_parameters() if not same_bits([owned(p)], [before[n]])}
    assert moved == set(before) - set(frozen), sorted(set(before) - set(frozen) - moved)


def tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter and optimizer state tensor (moments, loss scale), cloned: what two
    runs that should end alike are compared by (a refusal: `optimizer_snapshot`)."""
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


def _copied(value: Any) -> Any:
    """`value` with every tensor cloned (a DTensor as its local part), containers rebuilt."""
    if isinstance(value, torch.Tensor):
        return (value.to_local() if _is_dtensor(value) else value).detach().clone()
    if isinstance(value, dict):
        return {key: _copied(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_copied(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # an Int8Buffer
        return {
            field.name: _copied(getattr(value, field.name)) for field in dataclasses.fields(value)
        }
    return value


def _tensor_attributes(holder: Any) -> dict[str, Any]:
    """The tensors `holder` keeps as attributes (and dicts of tensors), cloned."""
    if holder is None:
        return {}
    return {
        name: _copied(value)
        for name, value in vars(holder).items()
        if isinstance(value, torch.Tensor)
        or (isinstance(value, dict) and all(isinstance(v, torch.Tensor) for v in value.values()))
    }


# What a norm pass measures afresh each time it runs (its sums of squares and overflow flag):
# not state, as a norm pass may run, whole or in part, before a refusal.
MEASURED = ("sumsq", "param_sumsq", "measured_slots", "norm_found_inf")


def _device_scalars(scalars: Any) -> dict[str, Any]:
    """One device's scalars (lr, overflow flag of the update, clip coefficient, inverse
    scale), without what a norm pass measures (`MEASURED`)."""
    return {k: v for k, v in _tensor_attributes(scalars).items() if k not in MEASURED}


# The step reports a refused call must leave as they were: the step count, and the names
# of the parameters an interrupted update pass had updated (none). Not compared: the norms
# a norm pass measures (one may run before a refusal), `last_step_interrupted` (about the
# last call: a refusal raised inside the update pass, before any update, sets it) and the
# last step's outcome, compared as `_outcome`.
REPORTS = ("step_count", "last_step_partial_names")


def _outcome(opt) -> dict[str, Any]:
    """The last step's outcome as the next `flush_report()` leaves it: read from the pending
    report's device flags (overflow count, overflow at the minimum scale, whether the step
    was atomic) while one is pending, else from `last_step_skipped` / `last_step_partial`.
    A call reports the previous step first (docs/usage.md), so a refused call may deliver
    the pending report; losing, altering or adding one is a change."""
    reports = opt._reports
    if reports._report is None:
        return {"skipped": opt.last_step_skipped, "partial": opt.last_step_partial}
    if reports._report_event is not None:
        reports._report_event.synchronize()  # the non-blocking copy into pinned memory
    found, at_min, atomic = reports._report.tolist()
    assert not at_min, "a pending overflow at the minimum loss scale: the snapshot would raise"
    return {"skipped": bool(found) and bool(atomic), "partial": bool(found) and not atomic}


def _accumulation(opt) -> dict[str, Any]:
    """Gradient accumulation's pending micro-batches: their count, buffers (by parameter
    index) and, while some are pending, the norm and flag they measured so far (the device
    scalars' `MEASURED`, which no norm pass can change then: grad_norm is refused)."""
    accumulation = opt._accumulation
    if accumulation is None:
        return {}
    index = opt._groups.index_of
    measured = {}
    if accumulation.pending:
        for device, scalars in opt._scalars.items():
            kept = _tensor_attributes(scalars)
            measured[str(device)] = {k: v for k, v in kept.items() if k in MEASURED}
    return {
        "pending": accumulation.pending,
        "buffers": {index[id(p)]: _copied(b) for p, b, _ in accumulation.buffered()},
        "measured": measured,
    }


def optimizer_snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Everything a refused call must leave as it was, copied: the parameters (this rank's
    owned elements where sharded) and buffers, `opt.state`, `state_dict()` (step count, loss scaler,
    single-backward norm history, param groups), the step reports (`REPORTS`), the last
    step's outcome (`_outcome`), the loss scaler's tensors, the single-backward rule's
    running tensors (norm history, the step's sum and skip count) and the per-device
    scalars (overflow flags, sums, lr, clip coefficient)."""
    return {
        "parameters": snapshot(model),
        "buffers": [b.detach().clone() for b in model.buffers()],
        "state": [_copied(dict(s)) for s in opt.state.values()],
        # state_dict() refuses while micro-batches are pending: the same content, read past
        # that refusal, and the accumulation itself.
        "state_dict": _copied(opt._checkpoint.state_dict(opt)),
        "accumulation": _accumulation(opt),
        "reports": {name: _copied(getattr(opt, name)) for name in REPORTS},
        "outcome": _outcome(opt),
        "loss_scaler": _tensor_attributes(getattr(opt, "loss_scaler", None)),
        "single_backward": _tensor_attributes(opt._single_backward_clip),
        "device_scalars": {str(d): _device_scalars(s) for d, s in opt._scalars.items()},
    }


def assert_unchanged_since(before: dict[str, Any], model, opt) -> None:
    """Everything in `optimizer_snapshot` has the bits of `before`, naming what differs.
    A device's scalars are created at its first use: a device that had none before has
    nothing to compare (a refused first step may have created them)."""
    after = optimizer_snapshot(model, opt)
    after["device_scalars"] = {
        d: s for d, s in after["device_scalars"].items() if d in before["device_scalars"]
    }
    assert_same_state(before, after, "snapshot")


def changes_since(before: dict[str, Any], model, opt) -> str | None:
    """What `assert_unchanged_since` finds changed, as text (None: nothing): for a worker
    process, which reports its checks rather than asserting them."""
    try:
        assert_unchanged_since(before, model, opt)
    except AssertionError as exc:
        return str(exc)
    return None


def assert_refused(model, opt, call, error: type[BaseException], match: str) -> None:
    """`call()` raises `error` (message matching `match`) and changes nothing
    (`optimizer_snapshot`)."""
    before = optimizer_snapshot(model, opt)
    with pytest.raises(error, match=match):
        call()
    assert_unchanged_since(before, model, opt)


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
    elif isinstance(a, float) and isinstance(b, float):
        assert struct.pack("<d", a) == struct.pack("<d", b), f"{path}: {a!r} != {b!r}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"
