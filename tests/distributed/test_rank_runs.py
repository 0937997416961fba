"""The multi-rank launcher's repeat of a run that lost a rank to a gloo abort
(support/sharded_checks.py): the repeat starts from an emptied output folder, so a worker that
writes its outputs afresh runs again as it first did."""

from __future__ import annotations

import pytest
from support.sharded_checks import run_ranks

# Aborts as gloo does on its first run (told by a marker beside its output folder), after
# writing an output; a repeat over that output would fail to create it again.
WORKER = """
import sys
from pathlib import Path

out = Path(sys.argv[1])
(out / "made").mkdir()
first = out.parent / (out.name + ".aborted")
if not first.exists():
    first.touch()
    print("terminate called after throwing an instance of 'gloo::IoException'", flush=True)
    sys.exit(134)
"""


def test_a_run_repeated_after_a_gloo_abort_starts_from_an_empty_folder(tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.warns(RuntimeWarning, match="gloo abort; running it again"):
        assert run_ranks(worker, out, "aborting", nproc=1) == out
    assert (out / "made").is_dir() and (tmp_path / "out.aborted").exists()
