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

Whether trusted or not, a load reads only the files the manifest lists, within their recorded
sizes: the metadata's storage entries name plain files of the checkpoint's directory, each in
the manifest, and untransformed (torch's reader opens whatever path an entry names).

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

from .manifest import CheckpointError, is_plain_name

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


def loader_reason(error: Exception) -> str:
    """What torch's weights_only loader refused, from its long message."""
    pattern = r"WeightsUnpickler error:\s*([^\n]*?)(?: was not an allowed|\. |\n|$)"
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
        return loader_reason(error)
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


def from_the_file(error: BaseException) -> bool:
    """Whether `error`, raised while a checkpoint's file was read, says something of the
    file's content, not of the process (an interrupt, memory, the disk): only those make
    the checkpoint corrupt."""
    return isinstance(error, Exception) and not isinstance(error, MemoryError | OSError)


def load_client_state(file: Path, trusted: bool) -> Any:
    """The client_state in `file`; refuses one that holds other Python objects unless
    `trusted` (then unpickled as any pickle is: running the code it names), and one that is
    no torch.save file at all."""
    try:
        return torch.load(file, weights_only=not trusted)
    except pickle.UnpicklingError as error:
        if trusted:
            raise CheckpointError(f"{file} is not a torch.save file ({error})") from None
        raise CheckpointError(
            f"{file} holds a Python object that a load without running code refuses "
            f"({loader_reason(error)}): unpickling it would run whatever code the file "
            f"names. A client_state of {_ACCEPTED} loads as is; {_TRUST_ADVICE}"
        ) from None
    except Exception as error:
        if not from_the_file(error):
            raise
        raise CheckpointError(
            f"{file} is not a torch.save file ({type(error).__name__}: "
            f"{loader_reason(error)}): the checkpoint is corrupt or crafted"
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


def check_storage(metadata: Any, path: Path, files: dict[str, dict[str, int]]) -> None:
    """Refuses metadata whose storage entries read anything but the checkpoint's own files
    (`files`: the manifest's records): each entry a plain file name the manifest lists, its
    bytes within the file's recorded size, with no transform (a save writes none)."""
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        raise CheckpointError(f"{path / METADATA} holds no storage table: it is corrupt")
    for index, info in storage.items():
        where = f"{path / METADATA} places {getattr(index, 'fqn', index)!r}"
        name = getattr(info, "relative_path", None)
        if not is_plain_name(name) or name not in files:
            raise CheckpointError(
                f"{where} in {name!r}, which is not a file its manifest lists: a load reads "
                "the checkpoint's own files only; the metadata was crafted or corrupted"
            )
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not all(type(v) is int and v >= 0 for v in (offset, length)) or (
            offset + length > files[name]["bytes"]
        ):
            raise CheckpointError(
                f"{where} at bytes {offset!r}+{length!r} of {name}, which holds "
                f"{files[name]['bytes']}: the metadata was crafted or corrupted"
            )
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(
                f"{where} behind the transforms {info.transform_descriptors!r}, which a save "
                "never writes: the metadata was crafted, or written by another tool"
            )


class SafeReader(FileSystemReader):
    """torch's file reader with ``.metadata`` checked to read only the files the manifest
    lists (`check_storage`) and, unless `trusted`, unpickled by `_MetadataUnpickler`."""

    def __init__(self, path: Path, files: dict[str, dict[str, int]], trusted: bool) -> None:
        super().__init__(path)
        self._files = files
        self._trusted = trusted

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if self._trusted:
            try:
                metadata = super().read_metadata(*args, **kwargs)
            except Exception as error:
                if not from_the_file(error):
                    raise
                raise CheckpointError(
                    f"{Path(self.path) / METADATA} is not torch.distributed.checkpoint "
                    f"metadata ({type(error).__name__}: {error}): the checkpoint is corrupt"
                ) from None
        else:
            metadata = self._read_untrusted()
        check_storage(metadata, Path(self.path), self._files)
        return metadata

    def _read_untrusted(self) -> Any:
        path = Path(self.path) / METADATA
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except Exception as error:  # a crafted or damaged pickle fails in many ways
            if not from_the_file(error):
                raise
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
    """torch's load planner with the non-tensor entries loaded with weights_only=True (unless
    `trusted`); an entry that would run code is left out and named in `refused`.

    `read_through=True`: every entry is read and unpickled as a load would, but into a
    transient, so the state loaded into is left as it was: a checkpoint whose bytes do not
    hold what its metadata says fails here, before a load writes anything in place."""

    def __init__(self, trusted: bool = False, read_through: bool = False) -> None:
        super().__init__()
        self.refused: list[str] = []
        self._trusted = trusted
        self._read_through = read_through

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=not self._trusted)
        except pickle.UnpicklingError as error:
            self.refused.append(
                f"the checkpoint's {key!r} holds a Python object that a load without running "
                f"code refuses ({loader_reason(error)}); {_TRUST_ADVICE}"
            )
            return
        if self._read_through:
            return
        # Where torch's own planner puts it: its place in the nested state loaded into,
        # which holds every container on the way.
        if not self.flatten_state_dict:
            self.state_dict[key] = loaded
            return
        *parents, last = self.mappings[key]
        container = self.original_state_dict
        for part in parents:
            container = container[part]
        container[last] = loaded

    def resolve_tensor(self, read_item: Any) -> torch.Tensor:
        target = super().resolve_tensor(read_item)
        if self._read_through:  # one item's transient at a time, on the host
            return torch.empty(target.shape, dtype=target.dtype)
        return target


def reader_and_planner(
    path: Path, files: dict[str, dict[str, int]], trusted: bool, read_through: bool = False
) -> tuple[FileSystemReader, SafePlanner]:
    """The storage reader and load planner for the checkpoint at `path` whose manifest lists
    `files`: unpickling with pickle when `trusted`, else running no code (`read_through`: see
    `SafePlanner`)."""
    if not trusted and not TORCH_READS_TENSORS_SAFELY:
        raise CheckpointError(
            f"torch {torch.__version__} reads a checkpoint's tensors with pickle "
            "(weights_only=False before torch 2.6), which runs any code a crafted file names: "
            f"upgrade torch to 2.6 or newer, or {_TRUST_ADVICE}"
        )
    return SafeReader(path, files, trusted), SafePlanner(trusted, read_through)


def planner_refusal(planner: Any) -> None:
    """Raises the first refusal of a `SafePlanner` that loaded a state."""
    refused = getattr(planner, "refused", None)
    if refused:
        raise CheckpointError(refused[0])
