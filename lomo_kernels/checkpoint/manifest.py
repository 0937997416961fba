"""A checkpoint directory's manifest: every file it holds, with its size and CRC-32, written
last. A directory without one, or whose files differ from it, is not a whole checkpoint."""

from __future__ import annotations

import json
import os
import stat
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


def is_plain_name(name: object) -> bool:
    """Whether `name` names an entry of a directory itself: not a path into another
    directory (no separator, not '.' or '..'), so a name read from a checkpoint cannot
    reach outside it."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and not any(c in name for c in "/\\\0")
    )


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
        for name, record in files.items():
            if not _is_record(record):
                raise ValueError(f"the record of {name!r} is {record!r}")
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        message = f"{path} is unreadable ({error}): the checkpoint is corrupt"
        raise CheckpointError(message) from None
    outside = next((name for name in files if not is_plain_name(name)), None)
    if outside is not None:
        raise CheckpointError(
            f"{path} lists {outside!r}, which is not a file of {directory} itself: a "
            "checkpoint's files are plain names in its directory; the manifest was crafted or "
            "corrupted"
        )
    return body


def _is_record(record: object) -> bool:
    return isinstance(record, dict) and all(
        type(record.get(key)) is int and record[key] >= 0 for key in ("bytes", "crc32")
    )


def check_files(
    directory: Path,
    files: dict[str, dict[str, int]],
    names: list[str],
    follow_links: bool = False,
) -> None:
    """Refuses the first of `names` that is missing, not a regular file or differs from its
    manifest record. A symbolic link is refused unless `follow_links`: it could lead out of
    the checkpoint, to a file the process can read and the checkpoint's author cannot."""
    for name in names:
        path = directory / name
        expected = files[name]
        try:
            info = (os.stat if follow_links else os.lstat)(path)
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing: the checkpoint is incomplete") from None
        if stat.S_ISLNK(info.st_mode):
            raise CheckpointError(
                f"{path} is a symbolic link, which a load does not follow (it could lead out "
                "of the checkpoint): copy the checkpoint with its links resolved (cp -rL), or "
                "pass trust_checkpoint=True for one you trust (a hub cache's snapshot links "
                "its files)"
            )
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(
                f"{path} is not a regular file (a directory or a device): a checkpoint holds "
                "files only, so it is refused"
            )
        size = info.st_size  # a regular file's, not a link's
        if size != expected["bytes"]:
            raise CheckpointError(
                f"{path} holds {size} bytes, its manifest {expected['bytes']}: the file is "
                "truncated or was replaced; the checkpoint is corrupt"
            )
        if file_record(path)["crc32"] != expected["crc32"]:
            raise CheckpointError(
                f"{path} does not match its manifest's CRC-32: the file is corrupt"
            )
