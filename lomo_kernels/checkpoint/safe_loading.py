"""Reading a checkpoint back without running code it holds.

A pickle names the functions its loading calls, so a crafted file runs whatever it names the
moment it is unpickled (the manifest's CRC-32 proves a file whole, not harmless). Unless the
caller trusts the checkpoint (``trust_checkpoint=True``), nothing in it is unpickled by
plain pickle:

- ``client_state_<rank>.pt`` and the non-tensor entries torch.distributed.checkpoint stores
  (hyper-parameters, step count, loss scaler): ``torch.load(weights_only=True)``, which
  builds tensors, containers, numbers and strings only;
- the tensors: torch's own reader loads them with ``weights_only=True`` (torch >= 2.6;
  older torch is refused);
- ``.metadata``: an unpickler that builds only torch.distributed.checkpoint's metadata
  classes, ``torch.Size``, dtypes, layouts and paths.

`save_checkpoint` refuses, before writing anything, a value the same loader would refuse:
a checkpoint never holds what it cannot load. Imported when a checkpoint is written or read
(it imports torch.distributed.checkpoint).
"""

from __future__ import annotations

import dataclasses
import enum
import io
import pathlib
import pickle
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from .manifest import CheckpointError

TRUST = "trust_checkpoint=True"
METADATA = ".metadata"  # torch.distributed.checkpoint's
# torch < 2.6 reads a checkpoint's tensors with torch.load's default of the time:
# weights_only=False.
TORCH_READS_TENSORS_SAFELY = torch.torch_version.TorchVersion(torch.__version__) >= (2, 6)
_ACCEPTED = (
    "tensors, dicts, lists, tuples, numbers, strings, bools and None (and classes registered "
    "with torch.serialization.add_safe_globals)"
)
_TRUST_ADVICE = (
    f"pass {TRUST} only for a checkpoint you trust as you would a program you run (one you "
    "wrote, or from a source you trust)."
)


def _loader_reason(error: Exception) -> str:
    """What torch's weights_only loader refused, from its long message."""
    pattern = r"WeightsUnpickler error: ([^\n]*?)(?: was not an allowed|\. |\n|$)"
    found = re.search(pattern, str(error))
    return found.group(1) if found else str(error).split("\n", 1)[0]


def _round_trip_refusal(value: Any) -> str | None:
    """Why torch.load(weights_only=True) would not load what torch.save writes of `value`;
    None when it would."""
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
    except Exception as error:  # a lambda, a local class: pickle itself refuses
        return f"it cannot be pickled ({error})"
    buffer.seek(0)
    try:
        torch.load(buffer, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        return _loader_reason(error)
    return None


def unloadable(value: Any, name: str) -> str | None:
    """The deepest part of `value` (called `name`) that a weights_only load refuses, with
    why; None when all of it loads."""
    reason = _round_trip_refusal(value)
    if reason is None:
        return None
    if isinstance(value, dict):
        parts = value.items()
    elif isinstance(value, (list, tuple)):
        parts = enumerate(value)
    else:
        parts = ()
    for key, part in parts:
        found = unloadable(part, f"{name}[{key!r}]")
        if found is not None:
            return found
    return f"{name} (a {type(value).__name__}): {reason}"


def refuse_unloadable(value: Any, name: str) -> None:
    """Refuses (ValueError) a value a checkpoint could not load again, naming the key."""
    refused = unloadable(value, name)
    if refused is not None:
        raise ValueError(
            f"save_checkpoint: {refused}. A checkpoint is read back without running code "
            f"(torch.load(weights_only=True)), so it holds only {_ACCEPTED}: save the "
            "object's state (its state_dict(), its fields) instead. Nothing was written."
        )


def load_client_state(file: Path, trusted: bool) -> Any:
    """The client_state in `file`; refuses one that holds other Python objects unless
    `trusted` (then unpickled as any pickle is: running the code it names)."""
    if trusted:
        return torch.load(file, weights_only=False)
    try:
        return torch.load(file, weights_only=True)
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"{file} holds a Python object that a load without running code refuses "
            f"({_loader_reason(error)}): unpickling it would run whatever code the file "
            f"names. A client_state of {_ACCEPTED} loads as is; {_TRUST_ADVICE}"
        ) from None


def _data_classes(module: ModuleType) -> list[type]:
    """The dataclasses and enums `module` defines: building one only sets its fields."""
    return [
        v
        for v in vars(module).values()
        if isinstance(v, type)
        and v.__module__ == module.__name__
        and (dataclasses.is_dataclass(v) or issubclass(v, enum.Enum))
    ]


def _metadata_globals() -> dict[tuple[str, str], Any]:
    """What a checkpoint's metadata pickle may name, by (module, name)."""
    classes = [*_data_classes(dcp_metadata), *_data_classes(dcp_filesystem), torch.Size]
    allowed = {(c.__module__, c.__qualname__): c for c in classes}
    for path in (pathlib.PurePosixPath, pathlib.PosixPath, pathlib.PureWindowsPath):
        # A checkpoint id; pathlib's classes moved module in Python 3.13.
        allowed[("pathlib", path.__name__)] = allowed[(path.__module__, path.__name__)] = path
    kinds = (torch.dtype, torch.layout, torch.memory_format)
    allowed |= {("torch", k): v for k, v in vars(torch).items() if isinstance(v, kinds)}
    # torch pickles a layout as a call of this function with the layout's name: a lookup
    # that builds nothing else stands in for it.
    layouts = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
    allowed[("torch.serialization", "_get_layout")] = layouts.__getitem__
    return allowed


_METADATA_GLOBALS = _metadata_globals()


class _MetadataUnpickler(pickle.Unpickler):
    # Every call a pickle makes goes through a name it looks up here: only data classes.
    def find_class(self, module: str, name: str) -> Any:
        found = _METADATA_GLOBALS.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"it names {module}.{name}")
        return found


class SafeReader(FileSystemReader):
    """torch's file reader with ``.metadata`` unpickled by `_MetadataUnpickler`."""

    def read_metadata(self) -> Any:
        path = Path(self.path) / METADATA
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except Exception as error:  # a crafted or damaged pickle fails in many ways
            raise CheckpointError(
                f"{path} is not torch.distributed.checkpoint metadata ({error}): unpickling "
                f"it could run code the file names, so it is refused; {_TRUST_ADVICE}"
            ) from None
        # As torch's reader does after unpickling.
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """torch's load planner with the non-tensor entries loaded with weights_only=True; an
    entry that would run code is left out and named in `refused`."""

    def __init__(self) -> None:
        super().__init__()
        self.refused: list[str] = []

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as error:
            self.refused.append(
                f"the checkpoint's {key!r} holds a Python object that a load without running "
                f"code refuses ({_loader_reason(error)}); {_TRUST_ADVICE}"
            )
            return
        # Where torch's own planner puts it (after loading with weights_only=False): its
        # place in the nested state loaded into, which holds every container on the way.
        if not self.flatten_state_dict:
            self.state_dict[key] = loaded
            return
        *parents, last = self.mappings[key]
        container = self.original_state_dict
        for part in parents:
            container = container[part]
        container[last] = loaded


def reader_and_planner(path: Path, trusted: bool) -> tuple[FileSystemReader, Any]:
    """The storage reader and load planner for the checkpoint at `path`: torch's own (which
    unpickle with pickle) when `trusted`, else the ones that run no code."""
    if trusted:
        return FileSystemReader(path), None
    if not TORCH_READS_TENSORS_SAFELY:
        raise CheckpointError(
            f"torch {torch.__version__} reads a checkpoint's tensors with pickle "
            "(weights_only=False before torch 2.6), which runs any code a crafted file names: "
            f"upgrade torch to 2.6 or newer, or {_TRUST_ADVICE}"
        )
    return SafeReader(path), SafePlanner()


def planner_refusal(planner: Any) -> None:
    """Raises the first refusal of a `SafePlanner` that loaded a state."""
    refused = getattr(planner, "refused", None)
    if refused:
        raise CheckpointError(refused[0])
