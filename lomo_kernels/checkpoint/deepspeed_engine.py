"""DeepSpeed's ``engine.save_checkpoint`` / ``load_checkpoint`` for an engine trained by
Lomo/AdaLomo, with DeepSpeed's signatures and layout: ``<save_dir>/<tag>/`` and
``<save_dir>/latest``.

DeepSpeed's own methods carry the partitions only through a ZeRO optimizer, which a LOMO run
does not build (the engine is made without one). These save the partitioned parameters and
the optimizer's state with `save_checkpoint` (each rank its own shards, published whole),
write ``latest`` after every rank has finished, and resume at any world size. The default
tag is ``global_step<N>`` with N the optimizer's step count (the engine's own counter does
not move: ``engine.step()`` has nothing to do), the name transformers' Trainer looks for.
"""

from __future__ import annotations

import copy
import os
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import ranks
from .manifest import PARTIAL, CheckpointError, is_plain_name
from .sharded import load_checkpoint, save_checkpoint

LATEST = "latest"
_SERVED = "_lomo_checkpoint_optimizer"
# The engine's counters a checkpoint carries.
_COUNTERS = ("global_steps", "global_samples", "skipped_steps")


def _tag_of(optimizer: torch.optim.Optimizer, tag: Any) -> str:
    if tag is None:
        return f"global_step{int(getattr(optimizer, 'step_count', 0))}"
    tag = str(tag)
    if not is_plain_name(tag):
        raise ValueError(f"checkpoint tag {tag!r}: give a plain directory name")
    return tag


def _engine_state(engine: nn.Module, client_state: Any) -> dict[str, Any]:
    scheduler = getattr(engine, "lr_scheduler", None)
    return {
        "client_state": client_state,
        "lr_scheduler": None if scheduler is None else scheduler.state_dict(),
        **{counter: getattr(engine, counter, 0) for counter in _COUNTERS},
    }


def _write_latest(save_dir: Path, tag: str) -> None:
    # Written into a new file (a link left at its name is replaced, not followed) and renamed
    # over `latest` (which replaces a link there too).
    partial = save_dir / f"{LATEST}{PARTIAL}"
    partial.unlink(missing_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(partial, flags, 0o644)  # as open() creates it (the umask applies)
    with os.fdopen(fd, "w") as f:
        f.write(tag)
    os.replace(partial, save_dir / LATEST)


def _loads_into(scheduler: Any, saved: Any) -> BaseException | None:
    """Why `scheduler.load_state_dict(saved)` fails (None: it loads), tried on the scheduler
    itself and undone: its own state loaded back, attributes the try added removed."""
    before, attributes = scheduler.state_dict(), set(vars(scheduler))
    try:
        scheduler.load_state_dict(copy.deepcopy(saved))
    except Exception as error:
        return error
    finally:
        for name in set(vars(scheduler)) - attributes:
            delattr(scheduler, name)
        scheduler.load_state_dict(before)
    return None


def _engine_state_check(
    engine: nn.Module, restore_schedule: bool, restore_counters: bool
) -> Callable[[Any], None]:
    """The check of a saved `_engine_state` that the load runs before anything changes: what
    the load then sets on the engine (the scheduler's state, the counters) can be set."""

    def check(saved: Any) -> None:
        if saved is None:
            return
        if not isinstance(saved, dict):
            raise CheckpointError(
                f"the checkpoint's client_state is a {type(saved).__name__}, not the dict an "
                "engine's save writes: it was written by another tool"
            )
        scheduler = getattr(engine, "lr_scheduler", None)
        schedule = saved.get("lr_scheduler")
        failed = None
        if restore_schedule and scheduler is not None and schedule is not None:
            failed = _loads_into(scheduler, schedule)
        if failed is not None:
            raise CheckpointError(
                f"the checkpoint's lr_scheduler state does not load into this engine's "
                f"{type(scheduler).__name__} ({type(failed).__name__}: {failed}): it was "
                "saved with another scheduler or param-group set-up "
                "(load_lr_scheduler_states=False leaves it out)"
            )
        for counter in _COUNTERS if restore_counters else ():
            value = saved.get(counter, 0)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise CheckpointError(
                    f"the checkpoint's {counter} is {value!r}, not an int >= 0: it is corrupt"
                )

    return check


def serve_engine_checkpoints(engine: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Replaces `engine`'s ``save_checkpoint``/``load_checkpoint`` with sharded ones that
    carry `optimizer` (`restore_engine_checkpoints` undoes it). The engine holds the
    optimizer weakly: dropping the optimizer still releases it and its hooks."""
    held = weakref.ref(optimizer)

    def served() -> torch.optim.Optimizer:
        live = held()
        if live is None:
            raise RuntimeError(
                "the Lomo/AdaLomo optimizer this engine's checkpoints carry was dropped: build "
                "the optimizer on the engine again before saving or loading"
            )
        return live

    def save(
        save_dir: str | os.PathLike,
        tag: Any = None,
        client_state: Any = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """DeepSpeed's ``save_checkpoint``, sharded: every rank calls it. `client_state`
        holds what `lomo_kernels.save_checkpoint` accepts (else refused, nothing written)."""
        save_dir = Path(save_dir)
        optimizer = served()
        name = _tag_of(optimizer, tag)
        save_checkpoint(
            save_dir / name,
            engine,
            optimizer,
            client_state=_engine_state(engine, client_state or {}),
            frozen=not exclude_frozen_parameters,
        )
        if save_latest and ranks.rank() == 0:
            _write_latest(save_dir, name)
        ranks.barrier()
        return True

    def load(
        load_dir: str | os.PathLike,
        tag: Any = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
        *,
        trust_checkpoint: bool = False,
    ) -> tuple[str | None, Any]:
        """DeepSpeed's ``load_checkpoint``: (the checkpoint's path, its client_state), or
        (None, None) when ``latest`` is missing and no tag was given (refused when a save
        that did not finish is there instead). Reads no pickle that runs code unless
        `trust_checkpoint=True` (`lomo_kernels.load_checkpoint`)."""
        if custom_load_fn is not None:
            raise ValueError(
                "load_checkpoint(custom_load_fn=...) is not served for an engine trained by "
                "Lomo/AdaLomo: its checkpoints are torch.distributed.checkpoint directories "
                "(lomo_kernels.load_checkpoint reads them)"
            )
        load_dir = Path(load_dir)
        optimizer = served()
        if tag is None:
            latest = load_dir / LATEST
            if not latest.is_file():
                unfinished = sorted(load_dir.glob(f"*{PARTIAL}"))
                if unfinished:
                    raise CheckpointError(
                        f"{latest} is missing and {unfinished[0]} holds a save that did not "
                        "finish (a rank died or the job stopped while it was written): resume "
                        "from an earlier checkpoint"
                    )
                return None, None
            tag = latest.read_text().strip()
        path = load_dir / _tag_of(optimizer, tag)
        with_optimizer = load_optimizer_states and not load_module_only
        restore_schedule = load_lr_scheduler_states and not load_module_only
        saved = load_checkpoint(
            path,
            engine,
            optimizer if with_optimizer else None,
            strict=load_module_strict,
            trust_checkpoint=trust_checkpoint,
            check_client_state=_engine_state_check(engine, restore_schedule, not load_module_only),
        )
        saved = saved or {}
        scheduler = getattr(engine, "lr_scheduler", None)
        if scheduler is not None and saved.get("lr_scheduler") is not None and restore_schedule:
            scheduler.load_state_dict(saved["lr_scheduler"])
        if not load_module_only:
            for counter in _COUNTERS:
                if counter in saved and hasattr(engine, counter):
                    setattr(engine, counter, saved[counter])
        return str(path), saved.get("client_state")

    engine.save_checkpoint = save
    engine.load_checkpoint = load
    engine.__dict__[_SERVED] = held


def restore_engine_checkpoints(engine: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Gives `engine` its own ``save_checkpoint``/``load_checkpoint`` back, unless another
    optimizer has been served on it since `optimizer`."""
    held = engine.__dict__.get(_SERVED)
    if held is not None and held() is optimizer:
        for name in ("save_checkpoint", "load_checkpoint", _SERVED):
            engine.__dict__.pop(name, None)
