"""A checkpoint directory's manifest: every file it holds, with its size and CRC-32, written
last. A directory without one, or whose files differ from it, is not a whole checkpoint."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
# A directory (or file) being written: published under its own name once whole.
PARTIAL = ".partial"
FORMAT = 1
_CHUNK = 16 << 20


class CheckpointError(ValueError):
    """A checkpoint that is incomplete, corrupt or of another set-up; nothing was loaded."""


def file_record(path: Path) -> dict[str, int]:
    """A file's size and CRC-32, read in chunks."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return {"bytes": path.stat().st_size, "crc32": crc}


def write_manifest(directory: Path, files: dict[str, dict[str, int]], world_size: int) -> None:
    """Writes the manifest of `files` (name -> `file_record`) and flushes it to disk."""
    body = {"format": FORMAT, "world_size": world_size, "files": dict(sorted(files.items()))}
    path = directory / MANIFEST
    with open(path, "w") as f:
        json.dump(body, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest of the checkpoint in `directory`; refuses a missing or unreadable one,
    naming it (and the unfinished save beside it, if there is one)."""
    path = directory / MANIFEST
    partial = directory.with_name(directory.name + PARTIAL)
    if not directory.is_dir():
        if partial.is_dir():
            raise CheckpointError(
                f"no checkpoint at {directory}: {partial} holds a save that did not finish "
                f"(it has no {MANIFEST}: a rank died or the job stopped while it was written); "
                "resume from an earlier checkpoint"
            )
        raise CheckpointError(f"no checkpoint at {directory}: the directory does not exist")
    if not path.is_file():
        raise CheckpointError(
            f"{path} is missing: {directory} is not a whole checkpoint (its save did not "
            "finish, or it was not written by lomo_kernels.save_checkpoint)"
        )
    try:
        body = json.loads(path.read_text())
        files = body["files"]
        if body.get("format") != FORMAT or not isinstance(files, dict):
            raise ValueError(f"format {body.get('format')!r}")
    except (ValueError, KeyError, TypeError) as error:
        message = f"{path} is unreadable ({error}): the checkpoint is corrupt"
        raise CheckpointError(message) from None
    return body


def check_files(directory: Path, files: dict[str, dict[str, int]], names: list[str]) -> None:
    """Refuses the first of `names` that is missing or differs from its manifest record."""
    for name in names:
        path = directory / name
        expected = files[name]
        if not path.is_file():
            raise CheckpointError(f"{path} is missing: the checkpoint is incomplete")
        size = path.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointError(
                f"{path} holds {size} bytes, its manifest {expected['bytes']}: the file is "
                "truncated or was replaced; the checkpoint is corrupt"
            )
        if file_record(path)["crc32"] != expected["crc32"]:
            raise CheckpointError(
                f"{path} does not match its manifest's CRC-32: the file is corrupt"
            )
