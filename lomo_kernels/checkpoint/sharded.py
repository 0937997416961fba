"""Saving and loading a sharded run's model and optimizer, each rank its own part, through
torch.distributed.checkpoint; whole or not at all.

A save writes into ``<path>.partial``, then a manifest (every file's size and CRC-32), and
publishes the directory by renaming it: a save a rank died in never appears at ``<path>``.
A load checks the manifest (every file the load reads listed, as a plain file of the
directory), every tensor's name and shape and the client_state, reads every entry once into
transients (a file whose bytes do not hold what the metadata says fails there), then loads
the optimizer's state into copies and lets the optimizer check it on every rank, and only
then applies it and loads the parameters: a checkpoint of another model, optimizer or set-up,
a crafted one, or one holding a pickle that would run code (safe_loading.py), is refused, on
every rank alike, before anything changes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import ranks
from .manifest import (
    MANIFEST,
    PARTIAL,
    CheckpointError,
    check_files,
    file_record,
    read_manifest,
    write_manifest,
)
from .state import (
    MODEL,
    OPTIMIZER,
    after_model_load,
    apply_optimizer_state,
    check_against_metadata,
    flat_entries,
    flat_where_saved_flat,
    model_state,
    optimizer_state,
    with_saved_group_extras,
    without_unsaved_aliases,
)

_REPLACED = ".replaced"


def _dcp() -> Any:
    # torch.distributed.checkpoint is imported when a checkpoint is written or read, not
    # with the package (it pulls in FSDP's modules: ~0.2 s).
    import torch.distributed.checkpoint as dcp

    return dcp


def _safe_loading() -> Any:
    # Imported with torch.distributed.checkpoint, when a checkpoint is written or read.
    from . import safe_loading

    return safe_loading


@contextlib.contextmanager
def _one_process_is_intended() -> Iterator[None]:
    # torch warns on every save and load without a process group; here that is intended.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def client_state_file(rank: int) -> str:
    return f"client_state_{rank}.pt"


def save_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    client_state: Any = None,
    frozen: bool = True,
) -> Path:
    """Saves `model` and `optimizer` (Lomo, AdaLomo or any torch optimizer) to the
    directory `path`, each rank writing its own shards; every rank calls it (a collective).

    `client_state`: what this rank wants back from `load_checkpoint` (a step counter, RNG
    states): tensors, dicts, lists, tuples, numbers, strings, bools and None, what
    ``torch.load(weights_only=True)`` loads. Any other object is refused (on every rank,
    naming its key) before anything is written: a load runs no code. `frozen=False` leaves
    out parameters that do not require a gradient. An existing checkpoint at `path` is
    replaced only once the new one is whole.
    """
    path = Path(path)
    partial = path.with_name(path.name + PARTIAL)
    rank, world = ranks.rank(), ranks.world_size()
    state: dict[str, Any] = {MODEL: model_state(model, frozen=frozen)}
    if optimizer is not None:
        state[OPTIMIZER] = optimizer_state(model, optimizer)
    _refuse_what_would_not_load(state, client_state)
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # a save that died before
        partial.mkdir(parents=True)
    ranks.barrier()
    with _one_process_is_intended():
        _dcp().save(state, checkpoint_id=partial, no_dist=not ranks.distributed())
    torch.save(client_state, partial / client_state_file(rank))
    ranks.barrier()
    # Every rank checksums its share of the files; rank 0 writes the manifest last.
    names = ranks.from_rank0(sorted(f.name for f in partial.iterdir()) if rank == 0 else None)
    share = {name: file_record(partial / name) for name in names[rank::world]}
    records = {k: v for part in ranks.gathered(share) for k, v in part.items()}
    if rank == 0:
        write_manifest(partial, records, world)
        _publish(partial, path)
    ranks.barrier()
    return path


def _refuse_what_would_not_load(state: dict[str, Any], client_state: Any) -> None:
    # torch.distributed.checkpoint pickles the non-tensor entries (hyper-parameters, step
    # count) as client_state is: both are read back with weights_only=True.
    entries = {k: v for k, v in flat_entries(state) if not isinstance(v, torch.Tensor)}
    error: Exception | None = None
    try:
        _safe_loading().refuse_unloadable(client_state, "client_state")
        _safe_loading().refuse_unloadable(entries, "the optimizer's state")
    except ValueError as refusal:
        error = refusal
    ranks.agree(error)


def _publish(partial: Path, path: Path) -> None:
    replaced = path.with_name(path.name + _REPLACED)
    if path.exists():
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(path, replaced)
    os.replace(partial, path)
    shutil.rmtree(replaced, ignore_errors=True)
    _sync_directory(path.parent)


def _sync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def verify_checkpoint(path: str | os.PathLike, *, follow_links: bool = False) -> dict[str, Any]:
    """The manifest of the whole checkpoint at `path`, after every rank checked its share of
    the files against it; refuses (on every rank alike) a missing, incomplete or corrupt one,
    naming the file, and one whose files are symbolic links unless `follow_links`."""
    path = Path(path)
    manifest: dict[str, Any] | None = None
    error: Exception | None = None
    try:
        manifest = read_manifest(path)
        _refuse_missing_records(path, manifest)
        names = sorted(manifest["files"])
        share = names[ranks.rank() :: ranks.world_size()]
        check_files(path, manifest["files"], share, follow_links)
    except ValueError as refusal:
        error = refusal
    ranks.agree(error)
    assert manifest is not None
    return manifest


def _refuse_missing_records(path: Path, manifest: dict[str, Any]) -> None:
    """Refuses a manifest that leaves out a file every save writes: a load reads only what the
    manifest vouches for."""
    world = manifest.get("world_size")
    if type(world) is not int or world < 1:
        raise CheckpointError(f"{path / MANIFEST} gives no world size: the checkpoint is corrupt")
    needed = [_safe_loading().METADATA, *(client_state_file(r) for r in range(world))]
    unlisted = next((name for name in needed if name not in manifest["files"]), None)
    if unlisted is not None:
        raise CheckpointError(
            f"{path / MANIFEST} does not list {unlisted}, which every save writes: the "
            "manifest was edited, or the directory was not written by save_checkpoint"
        )


def load_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    strict: bool = True,
    trust_checkpoint: bool = False,
    check_client_state: Callable[[Any], None] | None = None,
) -> Any:
    """Loads a `save_checkpoint` directory into `model` and `optimizer` at this run's world
    size (every rank calls it) and returns this rank's `client_state` (rank 0's where the
    checkpoint was written at another world size, as DeepSpeed keeps rank 0's alone).

    Refused before anything changes, on every rank alike: an incomplete or corrupt
    checkpoint (naming the file), one of another model, optimizer class, hyper-parameter
    set-up or sharding engine. `strict=False` loads a model whose parameters are a superset
    of the checkpoint's (frozen parameters left out of it).

    Nothing in the checkpoint runs code as it is read: a client_state (or an entry) holding
    other Python objects than `save_checkpoint` accepts is refused, naming the file.
    `trust_checkpoint=True` unpickles such objects (and reads with torch < 2.6, which
    unpickles the tensors), and follows files that are symbolic links (a hub cache's
    snapshot): it runs whatever code the files name, so pass it only for a checkpoint you
    trust as you would a program you run.

    `check_client_state(client_state)`, if given, runs before anything changes: a ValueError
    it raises refuses the load (on every rank alike).
    """
    path = Path(path)
    # Lomo's and AdaLomo's micro-batches waiting in their buffers, which a loaded step would
    # mix with: refused, naming this call, before any file is read.
    refuse_pending = getattr(optimizer, "refuse_pending_micro_batches", None)
    if refuse_pending is not None:
        refuse_pending("load_checkpoint()")
    manifest = verify_checkpoint(path, follow_links=trust_checkpoint)
    files = manifest["files"]
    state: dict[str, Any] = {MODEL: model_state(model)}
    if optimizer is not None:
        state[OPTIMIZER] = optimizer_state(model, optimizer)
    error: Exception | None = None
    try:
        reader, _ = _safe_loading().reader_and_planner(path, files, trust_checkpoint)
        saved = reader.read_metadata().state_dict_metadata
        state[MODEL] = without_unsaved_aliases(flat_where_saved_flat(state[MODEL], saved), saved)
        if not strict:
            state[MODEL] = {k: v for k, v in state[MODEL].items() if f"{MODEL}.{k}" in saved}
        if optimizer is not None:
            state[OPTIMIZER] = with_saved_group_extras(state[OPTIMIZER], saved, optimizer)
        check_against_metadata(state, saved, strict_model=strict)
        client_state = _client_state(path, manifest, trust_checkpoint)
        if check_client_state is not None:
            check_client_state(client_state)
    except ValueError as refusal:
        error = refusal
    ranks.agree(error)
    # Read once into transients: the parameters (and a torch optimizer's state) are loaded
    # in place below, so whatever can fail in reading them must fail here.
    error = None
    try:
        _safe_loading().planner_refusal(
            _load(state, path, files, trust_checkpoint, read_through=True)
        )
    except ValueError as refusal:
        error = refusal
    ranks.agree(error)
    if optimizer is not None:
        planner = _load({OPTIMIZER: state[OPTIMIZER]}, path, files, trust_checkpoint)
        # Checked on every rank before any rank applies it (Lomo and AdaLomo can say; a
        # torch optimizer is applied as torch loads it).
        check = getattr(optimizer, "check_state_dict", None)
        error = None
        try:
            _safe_loading().planner_refusal(planner)
            if check is not None:
                check(state[OPTIMIZER])
        except ValueError as refusal:
            error = refusal
        ranks.agree(error)
        apply_optimizer_state(model, optimizer, state[OPTIMIZER])
    # Tensors only, read through once above: nothing here can be refused.
    _load({MODEL: state[MODEL]}, path, files, trust_checkpoint)
    after_model_load(model)
    return client_state


def _load(
    state: dict[str, Any],
    path: Path,
    files: dict[str, dict[str, int]],
    trusted: bool,
    read_through: bool = False,
) -> Any:
    """Loads `state` from the checkpoint at `path` in place (`read_through`: reads it without
    loading it, `safe_loading.SafePlanner`); returns the planner, which holds the entries
    refused as running code (`safe_loading.planner_refusal`). A read that fails is refused as
    a corrupt checkpoint (torch raises it as a BaseException, past ``except Exception``)."""
    reader, planner = _safe_loading().reader_and_planner(path, files, trusted, read_through)
    try:
        with _one_process_is_intended():
            _dcp().load(
                state, storage_reader=reader, planner=planner, no_dist=not ranks.distributed()
            )
    except _dcp().CheckpointException as failed:
        error, _ = next(iter(failed.failures.values()))
        if isinstance(error, CheckpointError):
            raise error from None
        if not _safe_loading().from_the_file(error):
            raise  # an interrupt, memory, the disk: not the checkpoint's fault
        reason = _safe_loading().loader_reason(error)
        raise CheckpointError(
            f"reading {path} failed ({type(error).__name__}: {reason}): its files do not hold "
            "what its metadata says; the checkpoint is corrupt or crafted"
        ) from None
    return planner


def _client_state(path: Path, manifest: dict[str, Any], trusted: bool) -> Any:
    same_world = manifest["world_size"] == ranks.world_size()
    name = client_state_file(ranks.rank() if same_world else 0)
    return _safe_loading().load_client_state(path / name, trusted)


__all__ = ["MANIFEST", "load_checkpoint", "save_checkpoint", "verify_checkpoint"]
