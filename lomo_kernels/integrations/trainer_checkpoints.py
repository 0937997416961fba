"""Which Trainer checkpoint ``train(resume_from_checkpoint=True)`` resumes from: the newest
one that is whole.

transformers writes a checkpoint folder file by file and takes the newest ``checkpoint-N``
folder, whole or not: a run whose rank died while saving would be resumed from (and
refused by) the folder it left. LomoTrainer takes the newest folder holding everything a
resume reads, and names each newer one it passed over and what it lacks.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..checkpoint import MANIFEST
from ..checkpoint.deepspeed_engine import LATEST
from ..checkpoint.manifest import is_plain_name

_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")  # get_last_checkpoint's


def missing_part(folder: Path, sharded: bool) -> str | None:
    """What a resume reads that `folder` lacks ("<path> is missing"), or None when it is
    whole. `sharded`: the run resumes through DeepSpeed's engine checkpoint, whose tag in
    ``latest`` must name a folder of `folder` itself."""
    needed = [TRAINER_STATE_NAME, SCHEDULER_NAME]
    if sharded:
        latest = folder / LATEST
        if not latest.is_file():
            return f"{latest} is missing"
        tag = latest.read_text().strip()
        if not is_plain_name(tag):
            return f"{latest} names {tag!r}, not a checkpoint folder beside it"
        needed.append(f"{tag}/{MANIFEST}")
    else:
        needed.append(OPTIMIZER_NAME)
    lacking = (folder / name for name in needed if not (folder / name).is_file())
    return next((f"{path} is missing" for path in lacking), None)


def last_whole_checkpoint(output_dir: str, sharded: bool) -> str | None:
    """The newest whole ``checkpoint-N`` folder in `output_dir` (None without one), after
    warning about each newer one that is not."""
    root = Path(output_dir)
    found = root.iterdir() if root.is_dir() else ()
    folders = [p for p in found if p.is_dir() and _CHECKPOINT.match(p.name)]
    folders.sort(key=lambda p: int(_CHECKPOINT.match(p.name).group(1)), reverse=True)
    for folder in folders:
        missing = missing_part(folder, sharded)
        if missing is None:
            return str(folder)
        warnings.warn(
            f"resume_from_checkpoint=True passes over {folder}: {missing} (its save did not "
            "finish, or the folder was changed since)",
            UserWarning,
            stacklevel=3,
        )
    return None
