"""torch's and Triton's private names are read in `lomo_kernels.core.torch_internals` only,
and the package imports and trains eagerly on a torch that has none of them.

The source scans read the package with ast (nothing is imported). The run without the names
hides them from that one module, in a fresh interpreter, before the package is imported:
torch's own code reads the same names, so they cannot be deleted from torch itself.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

PACKAGE = Path(__file__).resolve().parents[2] / "lomo_kernels"
DOOR = PACKAGE / "core" / "torch_internals.py"
DOOR_MODULE = "lomo_kernels.core.torch_internals"
LIBRARIES = ("torch", "triton")
# Modules of Triton that are its implementation, not its language or launch API.
TRITON_INTERNAL_MODULES = ("triton.compiler", "triton.runtime", "triton.backends")


def private(name: str) -> bool:
    """A name starting with an underscore, not a dunder (``__version__`` is public)."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def internal_module(dotted: str) -> bool:
    """Whether a dotted torch/Triton module path is private or Triton's implementation."""
    parts = dotted.split(".")
    return any(private(p) for p in parts) or any(
        dotted == m or dotted.startswith(m + ".") for m in TRITON_INTERNAL_MODULES
    )


def package_modules() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text(), str(path)) for path in PACKAGE.rglob("*.py")}


def library_aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> the torch/Triton dotted path it is bound to, by any import in `tree`."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in LIBRARIES:
                    local = alias.asname or alias.name.split(".")[0]
                    aliases[local] = alias.name if alias.asname else local
        elif from_library(node):
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return aliases


def from_library(node: ast.AST) -> bool:
    """Whether `node` is a ``from torch... import`` or ``from triton... import``."""
    return (
        isinstance(node, ast.ImportFrom)
        and not node.level
        and (node.module or "").split(".")[0] in LIBRARIES
    )


def getattr_name(node: ast.AST) -> str | None:
    """The name a ``getattr(owner, "name"...)`` call reads, or None for any other node."""
    if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr"):
        return None
    if len(node.args) < 2 or not isinstance(node.args[1], ast.Constant):
        return None
    return str(node.args[1].value)


def dotted(node: ast.expr, aliases: dict[str, str]) -> str | None:
    """The torch/Triton path an attribute chain such as ``tl.standard.x`` names, or None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not (isinstance(node, ast.Name) and node.id in aliases):
        return None
    return ".".join([aliases[node.id], *reversed(parts)])


def private_library_names(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, name) of each private torch/Triton name `tree` imports or reads."""
    aliases = library_aliases(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if internal_module(a.name)]
        elif from_library(node):
            names = [f"{node.module}.{a.name}" for a in node.names]
            found += [(node.lineno, n) for n in names if internal_module(n)]
        elif isinstance(node, ast.Attribute) and private(node.attr):
            path = dotted(node, aliases)
            if path is not None:
                found.append((node.lineno, path))
        elif (name := getattr_name(node)) is not None and private(name):
            owner = dotted(node.args[0], aliases)
            if owner is not None:
                found.append((node.lineno, f"{owner}.{name}"))
    return found


def test_the_scan_finds_each_form_of_a_private_name():
    source = """
import torch
import triton.language as tl
from torch import _C
from torch._dynamo import compiled_autograd
from triton.compiler import ASTSource
torch._C._is_tracing()
tl.standard._sum_combine
getattr(torch.cuda, "_sleep")
torch.ops.aten.add.Tensor, torch.__version__, getattr(torch, "compile")
"""
    assert sorted(name for _, name in private_library_names(ast.parse(source))) == [
        "torch._C",  # the import
        "torch._C",  # torch._C in torch._C._is_tracing
        "torch._C._is_tracing",
        "torch._dynamo.compiled_autograd",
        "torch.cuda._sleep",
        "triton.compiler.ASTSource",
        "triton.language.standard._sum_combine",
    ]


def test_no_module_but_the_door_reads_a_private_torch_or_triton_name():
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {name}"
        for path, tree in package_modules().items()
        if path != DOOR
        for line, name in private_library_names(tree)
    ]
    assert not found, "read these through lomo_kernels.core.torch_internals:\n" + "\n".join(found)


def door_private_attributes() -> set[str]:
    """The private attribute names the door reads of torch's and Triton's objects."""
    # getattr's names, and those of a tuple the door looks names up from (the eager guards).
    names = {
        node.value
        for node in ast.walk(ast.parse(DOOR.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }
    return {n for n in names if private(n) and n.isidentifier()}


def test_no_module_but_the_door_reads_the_private_attributes_it_reads():
    """The private names the door reads of torch objects (an op's ``_schema``, a module's
    ``_non_persistent_buffers_set``), read anywhere else, as an attribute or by getattr."""
    names = door_private_attributes()
    assert {"_schema", "_increment_version", "_elementwise_max"} <= names  # the scan sees them
    found = []
    for path, tree in package_modules().items():
        if path == DOOR:
            continue
        for node in ast.walk(tree):
            name = node.attr if isinstance(node, ast.Attribute) else getattr_name(node)
            if name in names:
                found.append((path, node.lineno, name))
    assert not found, "read these through lomo_kernels.core.torch_internals:\n" + "\n".join(
        f"{path.relative_to(PACKAGE.parent)}:{line}: {name}" for path, line, name in found
    )


def test_the_door_reads_every_private_name_with_getattr_or_its_module_import():
    """So a missing name is a default, never an AttributeError or ImportError at a read, and
    hiding getattr's and import_module's private names hides every one (the run below)."""
    tree = ast.parse(DOOR.read_text())
    attributes = [
        f"{node.lineno}: .{node.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and private(node.attr)
    ]
    imports = [
        f"{node.lineno}: {name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for name in (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [f"{node.module}.{a.name}" for a in node.names]
        )
        if name.split(".")[0] in LIBRARIES and internal_module(name)
    ]
    assert not attributes and not imports, attributes + imports


# Run first, in the child: from the door's frames, getattr and importlib.import_module find
# no private name (torch's own code still finds them all).
HIDE_PRIVATE_NAMES = f"""
import builtins, importlib, sys

_getattr, _import_module, _ABSENT = builtins.getattr, importlib.import_module, object()


def _private(name):
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _hidden(name, caller):
    return _private(name) and caller.f_globals.get("__name__") == {DOOR_MODULE!r}


def getattr(owner, name, default=_ABSENT):
    if _hidden(name, sys._getframe(1)):
        if default is _ABSENT:
            raise AttributeError(name)
        return default
    return _getattr(owner, name) if default is _ABSENT else _getattr(owner, name, default)


def import_module(name, package=None):
    if any(_hidden(part, sys._getframe(1)) for part in name.split(".")):
        raise ModuleNotFoundError(name)
    return _import_module(name, package)


builtins.getattr = getattr
importlib.import_module = import_module
"""

# Then: the package, an eager Lomo and AdaLomo step on a small model, what the door found.
TRAIN_EAGERLY = """
import sys
import torch
import lomo_kernels
from lomo_kernels.core import torch_internals

def trained(cls):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5))
    opt = cls(model, lr=0.01, clip_grad_norm=1.0, backend="torch")
    for step in range(3):
        x = torch.randn(8, 12, generator=torch.Generator().manual_seed(step))
        opt.fused_backward(model(x).pow(2).mean())
    return [p.detach().clone() for p in model.parameters()]

try:
    torch_internals.enable_compiled_autograd(torch.compile(backend="eager"))
    refusal = ""
except torch_internals.MissingInternalError as missing:
    refusal = str(missing)
torch.save(
    {
        "lomo": trained(lomo_kernels.Lomo),
        "adalomo": trained(lomo_kernels.AdaLomo),
        "fast_path": torch_internals.dispatcher_bypass().available,
        "refusal": refusal,
    },
    sys.argv[1],
)
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict, dict]:
    """(with torch's private names, with them hidden from the door), each in a new process
    (side by side)."""
    folder = tmp_path_factory.mktemp("internals")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PACKAGE.parent), *sys.path])}
    scripts = {"present": TRAIN_EAGERLY, "hidden": HIDE_PRIVATE_NAMES + TRAIN_EAGERLY}
    children = {
        name: subprocess.Popen(
            [sys.executable, "-c", script, str(folder / f"{name}.pt")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name, script in scripts.items()
    }
    for name, child in children.items():
        output, _ = child.communicate(timeout=600)
        assert child.returncode == 0, f"{name}:\n{output[-4000:]}"
    return torch.load(folder / "present.pt"), torch.load(folder / "hidden.pt")


def test_without_private_names_eager_steps_match_bit_for_bit(runs):
    present, hidden = runs
    # The hiding took: the fast path's guards were there, then they were not.
    assert present["fast_path"] and not hidden["fast_path"]
    for name in ("lomo", "adalomo"):
        for a, b in zip(present[name], hidden[name], strict=True):
            assert torch.equal(a, b), name


def test_without_private_names_a_needed_one_is_refused_by_name_and_version(runs):
    present, hidden = runs
    assert present["refusal"] == ""
    message = hidden["refusal"]
    assert "torch._dynamo.compiled_autograd._enable" in message
    assert f"torch {torch.__version__}" in message
    assert "run the backward without compiled autograd" in message


@pytest.mark.parametrize("failure", ["torch's refusal", "another error"])
def test_norm_pass_over_a_backward_that_reuses_its_saved_buffers_is_refused_unchanged(failure):
    """A compiled forward whose backward was compiled reusing the buffers it saved (AOT's
    donated buffers, after a step with no norm pass): torch runs such a backward only once,
    so grad_norm, which keeps the graph for the update pass, is refused with the package's
    message, recognised by torch's refusal, and no parameter changes. Another error of
    that backward (here a hook's, raised before torch's check) is raised as it is, not
    explained as donated buffers."""
    from lomo_kernels import Lomo
    from lomo_kernels.optim._in_backward import DONATED_BUFFERS_ERROR

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    forward = torch.compile(model, backend="aot_eager")  # AOTAutograd's, with no cache

    def loss(step: int) -> torch.Tensor:
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(step))
        return forward(x).pow(2).mean()

    def fails(grad: torch.Tensor) -> None:
        raise RuntimeError("a hook's own error")

    torch._dynamo.reset()
    with Lomo(model, lr=0.05) as opt:
        opt.fused_backward(loss(0))  # one pass, the graph not kept: buffers reused
        before = [p.detach().clone() for p in model.parameters()]
        second = loss(1)
        if failure == "another error":
            second.register_hook(fails)
        with pytest.raises(RuntimeError) as refused:
            opt.grad_norm(second)
    if failure == "another error":
        assert str(refused.value) == "a hook's own error"
    else:
        assert str(refused.value) == DONATED_BUFFERS_ERROR
        assert "donated buffer" in str(refused.value.__cause__)  # torch's own, chained
    for a, b in zip(before, model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_donated_buffer_check_of_an_eager_graph_is_false():
    """Asked of a graph with no compiled node, the check walks all of it, inputs that need
    no gradient included (an empty slot in a node's inputs), and finds none."""
    from lomo_kernels.core.torch_internals import compiled_backward_donates_buffers

    weight = torch.randn(3, requires_grad=True)
    loss = (weight * torch.randn(3)).sum()  # the product's node: [weight's, an empty slot]
    assert [node is None for node, _ in loss.grad_fn.next_functions[0][0].next_functions] == [
        False,
        True,
    ]
    # torch's own patch: a monkeypatched config entry is deleted on undo, which hides it.
    with torch._functorch.config.patch(donated_buffer=True):
        assert compiled_backward_donates_buffers(loss) is False


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "one-by-one"])
def test_copy_each_copies_every_pair_with_or_without_torch_s_list_copy(foreach, monkeypatch):
    """The list copy of the sliced AdaLomo step's flags and sums: the same values whether
    torch has its one-op list copy or not (a release without it copies one by one)."""
    from lomo_kernels.core.torch_internals import copy_each_

    if not foreach:
        monkeypatch.delattr(torch, "_foreach_copy_")
    flat = torch.zeros(9)
    targets = [flat[0:1], flat[4:5], flat[8:9]]
    copy_each_(targets, list(torch.tensor([1.5, -2.0, 3.25]).split(1)))
    assert flat.tolist() == [1.5, 0, 0, 0, -2.0, 0, 0, 0, 3.25]
