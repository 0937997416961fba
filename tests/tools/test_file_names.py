"""The file and module names that comments, docstrings and the docs give hold.

A move or a rename leaves pointers behind: "see `ops/cross_entropy.py`" in a docstring, a
``python -m lomo_kernels.tools.demo`` in a page. Every file name (``dir/name.py``,
``name.md``, ...) in the Markdown pages, in the comments and docstrings of the Python files
and in the C++/CUDA sources must name a file of the repository, and every dotted name of the
package or of bench/ (``lomo_kernels.ops.backends``, ``bench.memory``) a module, or a name
that module defines. So the next move fails `make test` until its pointers follow.
"""

from __future__ import annotations

import ast
import io
import os
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ["lomo_kernels", "bench", "csrc", "tests", "examples", "docs"]
SKIPPED_DIRS = {"results", "__pycache__"}
SUFFIXES = (".py", ".md", ".h", ".cpp", ".cu", ".cuh")
FILE_NAME = re.compile(r"(?<![\w./*-])((?:[\w-]+/)*[\w-]+\.(?:py|h|cu|cuh|cpp|md))\b")
DOTTED = re.compile(r"(?<![\w./-])((?:lomo_kernels|bench)(?:\.\w+)+)")
# Named but not ours: system headers, files other projects or a run write.
ELSEWHERE = {
    "immintrin.h",
    "summary.md",
    "lomo_trainer.py",  # LOMO's official trainer
    "tests/trainer/test_trainer.py",  # transformers' tests
}
OTHER_PROJECTS = (
    "torch/",
    "transformers/",
    "deepspeed/",
    "triton/",
    "accelerate/",
    "c10/",
    "ATen/",
)
# This file plants stale names in its own docstring and tests.
PLANTED = Path(__file__).resolve()


def scanned_files() -> list[Path]:
    files = [p for p in ROOT.glob("*.md")]
    for top in SCANNED:
        for path in (ROOT / top).rglob("*"):
            if path.suffix in SUFFIXES and not SKIPPED_DIRS & set(path.parts) and path != PLANTED:
                files.append(path)
    return sorted(files)


def python_prose(text: str) -> str:
    """The comments and docstrings of a Python file, newline-separated."""
    parts = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                parts.append(doc)
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            parts.append(token.string)
    return "\n".join(parts)


def prose(path: Path) -> str:
    text = path.read_text()
    if path.suffix == ".py":
        return python_prose(text)
    if path.suffix == ".md":
        return text
    return "\n".join(line for line in text.splitlines() if not line.startswith("#include"))


def all_files() -> list[str]:
    """The repository's files (relative paths), without version control, venvs and builds."""
    files = []
    for folder, subfolders, names in os.walk(ROOT):
        subfolders[:] = [d for d in subfolders if not d.startswith((".git", ".venv", "site"))]
        files += [str((Path(folder) / name).relative_to(ROOT)) for name in names]
    return files


def file_name_holds(name: str, where: Path, files: list[str], names: set[str]) -> bool:
    if name in ELSEWHERE or name.startswith(OTHER_PROJECTS):
        return True
    if "/" not in name:
        return name in names
    return (
        (ROOT / name).exists()
        or (where.parent / name).exists()
        or any(f.endswith("/" + name) for f in files)
    )


def dotted_name_holds(dotted: str) -> bool:
    """`dotted` is a module of the package or of bench/, or a module followed by a name its
    source defines or imports (read as text, nothing imported)."""
    parts = dotted.split(".")
    path = ROOT / parts[0]
    for i, part in enumerate(parts[1:], start=1):
        if path.is_dir() and (path / part).is_dir():
            path = path / part
        elif path.is_dir() and (path / f"{part}.py").is_file():
            path = path / f"{part}.py"
        else:
            source = path / "__init__.py" if path.is_dir() else path
            if not source.is_file():
                return False
            # An attribute: the module defines or imports it (the rest, if any, is its attribute).
            return part in defined_names(source)
        del i
    return True


def defined_names(source: Path) -> set[str]:
    """The names a module's top level defines, assigns or imports."""
    names = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
    return names


def stale_names(path: Path, files: list[str], names: set[str]) -> list[str]:
    stale = []
    for number, line in enumerate(prose(path).splitlines(), start=1):
        for match in FILE_NAME.finditer(line):
            if not file_name_holds(match.group(1), path, files, names):
                stale.append(f"{path.relative_to(ROOT)}: {match.group(1)} (in: {line.strip()})")
        for match in DOTTED.finditer(line):
            dotted = match.group(1).rstrip(".")
            if dotted.split(".")[-1] in ("py", "md"):
                continue  # a file name, checked above
            if not dotted_name_holds(dotted):
                stale.append(f"{path.relative_to(ROOT)}: {dotted} (in: {line.strip()})")
        del number
    return stale


def test_every_named_file_and_module_exists() -> None:
    files = all_files()
    names = {Path(f).name for f in files}
    stale = [s for path in scanned_files() for s in stale_names(path, files, names)]
    assert stale == []


def test_the_checker_finds_a_moved_file_and_module(tmp_path: Path) -> None:
    page = ROOT / "docs" / "planted.md"  # never written: prose() is given the text below
    text = (
        "See `lomo_kernels/ops/backends.py`, `ops/cross_entropy/reference.py` and "
        "`lomo_kernels.ops.backends.resolve`.\n"
        "Gone: `lomo_kernels/tools/demo.py`, `no_such_file.py`, `lomo_kernels.tools.demo`, "
        "`bench.no_such_study`.\n"
    )
    files = all_files()
    names = {Path(f).name for f in files}
    found = []
    for line in text.splitlines():
        found += [
            m.group(1)
            for m in FILE_NAME.finditer(line)
            if not file_name_holds(m.group(1), page, files, names)
        ]
        found += [m.group(1) for m in DOTTED.finditer(line) if not dotted_name_holds(m.group(1))]
    assert found == [
        "lomo_kernels/tools/demo.py",
        "no_such_file.py",
        "lomo_kernels.tools.demo",
        "bench.no_such_study",
    ]


@pytest.mark.parametrize("source", ["# see lomo_kernels/gone.py\nx = 1\n", '"""gone.py"""\n'])
def test_python_comments_and_docstrings_are_read(source: str) -> None:
    assert "gone.py" in python_prose(source)
