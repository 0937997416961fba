"""Every benchmark command the documentation and the Makefile give runs as written from a
clone: ``python -m bench.<study> ...`` (and ``$(PY) -m bench.<study> ...`` in a make target).

Each command written out in full is parsed by its study's parser, as the study would parse
it (flags, values, output folders; a CUDA command as on a machine with one GPU), and every
study a command names starts from the repository's root (``--help`` in a fresh
interpreter). A synopsis (``[--device cpu|cuda]``, ``<study>``, placeholders such as ``B``)
only has its study checked. The studies themselves run at tiny sizes in the other tests of
this folder.
"""

from __future__ import annotations

import importlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.bench_cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = sorted(
    [ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "MEASURING.md", *ROOT.glob("docs/**/*.md")]
)
COMMAND = re.compile(r"(?:python|\$\(PY\)) -m (bench(?:\.\w+)*)\b([^`#|\n]*)")
MAKE_VARIABLES = {
    "$(RESULTS)": "bench/results",
    "$(DEVICE)": "cuda",
    "$(GPU_CHECK_RESULTS)": "bench/results/gpu-check",
    "$(BENCH_1B_BATCH)": "4",
    "$(BENCH_7B_BATCH)": "1",
}
# A synopsis, not a command: options in brackets, alternatives, placeholders in capitals.
SYNOPSIS = re.compile(r"[\[\]<>|]|\.\.\.|(?<![\w.-])[A-Z]{1,2}(?![\w.])|\bCONFIG\b|\bthat\.json\b")


def joined_lines(text: str) -> list[str]:
    """The lines of `text`, each continued line (a trailing backslash) joined to the next, and
    a code span broken over lines of prose (outside fenced blocks) on one line."""
    text = text.replace("\\\n", " ")
    parts = re.split(r"(^```.*?^```)", text, flags=re.M | re.S)
    for i in range(0, len(parts), 2):  # the prose between fenced blocks
        parts[i] = re.sub(r"`[^`]+`", lambda span: span.group(0).replace("\n", " "), parts[i])
    return "".join(parts).splitlines()


def documented_commands() -> list[tuple[str, str, str]]:
    """(where, module, arguments) of every benchmark command of the docs and the Makefile."""
    found = []
    sources = [*DOCUMENTS, ROOT / "Makefile"]
    for path in sources:
        for number, line in enumerate(joined_lines(path.read_text()), start=1):
            for match in COMMAND.finditer(line):
                arguments = match.group(2)
                for name, value in MAKE_VARIABLES.items():
                    arguments = arguments.replace(name, value)
                where = f"{path.relative_to(ROOT)}:{number}"
                found.append((where, match.group(1), " ".join(arguments.split())))
    return found


COMMANDS = documented_commands()
FULL = [c for c in COMMANDS if c[1] != "bench" and not SYNOPSIS.search(c[2])]
STUDIES = sorted({module for _, module, _ in COMMANDS})


def test_the_docs_give_commands() -> None:
    assert len(FULL) > 20 and "bench.demo" in STUDIES and "bench.gpu_check" in STUDIES


@pytest.mark.parametrize(("where", "module", "arguments"), FULL, ids=[c[0] for c in FULL])
def test_a_documented_command_parses_as_written(monkeypatch, where, module, arguments) -> None:
    monkeypatch.chdir(ROOT)  # output paths are relative to the clone's root
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    if not hasattr(importlib.import_module(module), "add_arguments"):
        assert arguments == ""  # a script without options (bench.data.make_checkpoint)
        return
    build_parser(module.removeprefix("bench.")).parse_args(shlex.split(arguments))


def test_every_documented_study_starts_from_the_clone() -> None:
    """Each study named is a module of bench/ run by ``python -m`` (a ``__main__`` block, or a
    package's __main__.py); one of them, and the list, start in a fresh interpreter from the
    root as a user starts them."""
    for study in STUDIES:
        path = ROOT.joinpath(*study.split("."))
        main = path / "__main__.py" if path.is_dir() else path.with_suffix(".py")
        assert main.is_file(), study
        assert path.is_dir() or 'if __name__ == "__main__":' in main.read_text(), study
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for argv in (["bench"], ["bench.demo", "--help"]):
        proc = subprocess.run(
            [sys.executable, "-m", *argv], cwd=ROOT, env=env, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "python -m bench." in proc.stdout
