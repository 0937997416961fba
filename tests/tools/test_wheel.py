"""The built wheel is the library: the package's modules, its C++/CUDA sources and the
`lomo-kernels` command, none of bench/, tests/ or examples/ (docs/cli.md gives its size).

The wheel is built as pip builds it (``pip wheel --no-deps --no-build-isolation``) from a
copy of the working tree, so the build leaves nothing behind in the repository.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from support.dependencies import require

ROOT = Path(__file__).resolve().parents[2]
LEFT_OUT = (".git", ".venv*", "build", "dist", "site", "*.egg-info", "__pycache__", "results")
# Nothing the benchmarks, the GPU check or the demo alone use: their modules, their corpus,
# their plotting and progress libraries, the private torch names only a benchmark reads.
BENCHMARK_ONLY = ("bench/", "gpu_check", "demo", "char_model", "corpus", "plots", "data/")
BENCHMARK_NAMES = ("_fused_sgd_", "cuda._sleep", "matplotlib", "tqdm")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    require("setuptools")
    source = tmp_path_factory.mktemp("source") / "lomo_kernels"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*LEFT_OUT))
    out = tmp_path_factory.mktemp("wheel")
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    proc = subprocess.run(
        [*build, "--no-index", "-w", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (path,) = out.glob("lomo_kernels-*.whl")
    return zipfile.ZipFile(path)


def test_the_wheel_holds_the_package_and_its_metadata_only(wheel: zipfile.ZipFile) -> None:
    tops = {name.split("/")[0] for name in wheel.namelist()}
    assert {top for top in tops if not top.endswith(".dist-info")} == {"lomo_kernels"}
    for part in ("bench/", "tests/", "examples/"):
        assert not [n for n in wheel.namelist() if n.startswith(part)]


def test_nothing_in_the_wheel_exists_for_the_benchmarks_or_the_demo(wheel) -> None:
    names = wheel.namelist()
    assert [n for n in names if any(word in n for word in BENCHMARK_ONLY)] == []
    sources = [n for n in names if n.endswith(".py")]
    found = {
        (n, word) for n in sources for word in BENCHMARK_NAMES if word in wheel.read(n).decode()
    }
    assert found == set()


def test_the_wheel_has_the_sources_the_extensions_build_from_and_the_command(wheel) -> None:
    """Every C++/CUDA source and header of csrc/ (as they are: the JIT build reads them from
    the installed package) and every module of the package, besides the command."""
    names = wheel.namelist()
    for source in sorted((ROOT / "csrc").iterdir()):
        assert wheel.read(f"lomo_kernels/csrc/{source.name}") == source.read_bytes(), source.name
    package = ROOT / "lomo_kernels"
    modules = {
        f"lomo_kernels/{path.relative_to(package).as_posix()}"
        for path in package.rglob("*.py")
        if "__pycache__" not in path.parts and "csrc" not in path.parts
    }
    assert modules <= set(names), sorted(modules - set(names))
    assert "lomo_kernels/tools/cli.py" in names and "lomo_kernels/tools/env.py" in names
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert "lomo-kernels = lomo_kernels.tools.cli:main" in wheel.read(entry_points).decode()
