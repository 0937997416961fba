"""The package's layers only point down, read from its source (ast; nothing is imported).

    core <- kernels <- ops <- compile <- optim <- integrations <- lomo_kernels <- tools
    core <- distributed <- optim

Every import counts, a function-level one too (a lazy import hides an upward edge from
import time, not from the design), and so does a string naming one of the package's modules
(what `importlib.import_module` is given). Two rules: no module imports a module of a higher layer
(or of a sibling on the same layer), and no group of modules imports itself round a cycle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lomo_kernels"

# Layer of each top-level part of the package; a part may import parts of lower layers only.
LAYERS = {
    "core": 0,
    "kernels": 1,
    "distributed": 1,
    "ops": 2,
    "checkpoint": 2,
    "compile": 3,
    "optim": 4,
    "integrations": 5,
    "": 6,  # the package root, lomo_kernels/__init__.py: the public names
    "tools": 7,  # the command line: estimate, env
    "__main__": 8,
}


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under `root` (a package directory)."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imported_modules(name: str, path: Path, known: Iterable[str]) -> set[str]:
    """The package's modules that module `name` imports anywhere in its body."""
    known = set(known)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            # A dotted name only: the bare package name is also the ops' library namespace.
            targets = [node.value] if "." in node.value and node.value in known else []
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # `from pkg import sub` imports the submodule `pkg.sub` when there is one.
            targets = [f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in known]
            targets = targets or [module]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    modules = module_files(root)
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def part_of(module: str) -> str:
    """The top-level part a dotted module belongs to ('' for the package root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def upward_edges(graph: dict[str, set[str]], layers: dict[str, int]) -> list[str]:
    bad = []
    for source, targets in graph.items():
        here = part_of(source)
        for target in targets:
            there = part_of(target)
            if here != there and layers[there] >= layers[here]:
                bad.append(f"{source} -> {target} ({here or 'root'} may not import {there})")
    return sorted(bad)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def test_every_part_has_a_layer():
    parts = {part_of(m) for m in module_files(PACKAGE)}
    assert parts <= set(LAYERS), f"parts without a layer: {sorted(parts - set(LAYERS))}"


def test_no_import_points_up():
    assert upward_edges(import_graph(PACKAGE), LAYERS) == []


def test_no_import_cycle():
    assert cycles(import_graph(PACKAGE)) == []


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "lomo_kernels"


@pytest.mark.parametrize("where", ["module", "function", "string"])
def test_a_planted_upward_import_is_found(tmp_path, where):
    body = "from ..optim import lomo\n"
    if where == "function":
        body = "def f():\n    from ..optim import lomo\n"
    if where == "string":
        body = "import importlib\nlomo = importlib.import_module('lomo_kernels.optim.lomo')\n"
    root = _write(
        tmp_path,
        {
            "lomo_kernels/__init__.py": "",
            "lomo_kernels/ops/__init__.py": "",
            "lomo_kernels/ops/head.py": body,
            "lomo_kernels/optim/__init__.py": "",
            "lomo_kernels/optim/lomo.py": "from ..ops import head\n",
        },
    )
    graph = import_graph(root)
    assert upward_edges(graph, LAYERS) == [
        "lomo_kernels.ops.head -> lomo_kernels.optim.lomo (ops may not import optim)"
    ]
    assert cycles(graph) == [["lomo_kernels.ops.head", "lomo_kernels.optim.lomo"]]


def test_a_planted_cycle_within_one_part_is_found(tmp_path):
    root = _write(
        tmp_path,
        {
            "lomo_kernels/__init__.py": "",
            "lomo_kernels/ops/__init__.py": "from . import a\n",
            "lomo_kernels/ops/a.py": "from .b import x\n",
            "lomo_kernels/ops/b.py": "import lomo_kernels.ops.a\nx = 1\n",
        },
    )
    graph = import_graph(root)
    assert upward_edges(graph, LAYERS) == []
    assert cycles(graph) == [["lomo_kernels.ops.a", "lomo_kernels.ops.b"]]
