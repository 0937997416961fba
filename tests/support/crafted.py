"""Checkpoint files crafted as a checkpoint shared by someone else could be: a pickle that
runs code as it is loaded, or one holding a custom class, put into a whole checkpoint whose
manifest is re-recorded (a CRC-32 proves a file whole, not harmless)."""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lomo_kernels.checkpoint.manifest import file_record, read_manifest, write_manifest


class RunsCode:
    """Unpickling it creates the file `marker`: proof that a load ran the file's code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@dataclass
class Progress:
    """A custom class a trusted checkpoint's client_state may hold."""

    epoch: int
    note: str


def rerecord_manifest(checkpoint: Path) -> None:
    """The manifest of every file in `checkpoint` as it is now."""
    world = read_manifest(checkpoint)["world_size"]
    names = sorted(f.name for f in checkpoint.iterdir() if f.name != "manifest.json")
    write_manifest(checkpoint, {name: file_record(checkpoint / name) for name in names}, world)


def plant_client_state(checkpoint: Path, rank: int, value: Any) -> Path:
    """Replaces rank `rank`'s client_state file with a pickle of `value`; returns the file."""
    file = checkpoint / f"client_state_{rank}.pt"
    torch.save(value, file)
    rerecord_manifest(checkpoint)
    return file


def plant_metadata(checkpoint: Path, value: Any) -> Path:
    """Replaces torch.distributed.checkpoint's `.metadata` with a pickle of `value`."""
    file = checkpoint / ".metadata"
    file.write_bytes(pickle.dumps(value))
    rerecord_manifest(checkpoint)
    return file


def rewrite_metadata(checkpoint: Path, change) -> Path:
    """Rewrites the checkpoint's `.metadata` (a test's own, so plain pickle reads it) after
    `change(metadata)`, with the manifest re-recorded; returns the file."""
    file = checkpoint / ".metadata"
    metadata = pickle.loads(file.read_bytes())
    change(metadata)
    metadata.storage_meta = None  # as torch writes it
    file.write_bytes(pickle.dumps(metadata))
    rerecord_manifest(checkpoint)
    return file


def storage_of(metadata, fqn: str):
    """(index, storage info) of the entry `fqn` in `metadata`'s storage table."""
    return next((i, info) for i, info in metadata.storage_data.items() if i.fqn == fqn)
