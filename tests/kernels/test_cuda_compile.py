"""Static checks of the CUDA kernels: they build with nvcc alone and the PTX is vectorised.

No GPU is needed; nothing here runs on one. Skipped only when nvcc is not installed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[2] / "csrc"
SOURCE = CSRC / "lomo_cuda.cu"
ADALOMO_SOURCE = CSRC / "adalomo_cuda.cu"
ARCHS = ["sm_80", "sm_90"]


def _find_nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    return None


NVCC = _find_nvcc()
pytestmark = pytest.mark.skipif(
    NVCC is None, reason="nvcc not found (no CUDA toolkit): CUDA sources not compiled"
)


def _nvcc(*args: str, source: Path = SOURCE) -> str:
    cmd = [NVCC, "-std=c++17", "-O3", f"-I{CSRC}", *args, str(source)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stderr[-4000:]}"
    return done.stdout + done.stderr


@pytest.fixture(scope="module", params=ARCHS)
def ptx(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("ptx") / f"lomo_cuda_{request.param}.ptx"
    _nvcc(f"-arch={request.param}", "-ptx", "-o", str(out))
    return out.read_text()


def _kernels(ptx_text: str) -> dict[str, str]:
    """Kernel entry name -> its PTX body."""
    parts = re.split(r"\.entry\s+", ptx_text)[1:]
    return {part.split("(", 1)[0].strip(): part for part in parts}


@pytest.mark.parametrize("arch", ARCHS)
def test_object_builds_without_spills(arch: str, tmp_path: Path) -> None:
    log = _nvcc(f"-arch={arch}", "-c", "-Xptxas", "-v", "-o", str(tmp_path / "lomo_cuda.o"))
    assert (tmp_path / "lomo_cuda.o").stat().st_size > 0
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores", log)
    assert len(frames) >= 48, log[-2000:]  # one line per kernel
    assert all(frame == ("0", "0") for frame in frames), log[-2000:]


def test_all_kernels_instantiated(ptx: str) -> None:
    names = list(_kernels(ptx))
    updates = [n for n in names if "lomo_update_kernel" in n]
    sumsqs = [n for n in names if "grad_sumsq_kernel" in n]
    # 9 param x grad dtype pairs, plus stochastic rounding for the 6 with bf16 or fp16 params
    # (the template's last argument, Lb1).
    assert len(updates) == 15, names
    stochastic = sorted(n for n in updates if "Lb1E" in n)
    assert len(stochastic) == 6, names
    assert sum("4Bf16" in n.split("lomo_update_kernel")[1][:12] for n in stochastic) == 3
    assert sum("4Fp16" in n.split("lomo_update_kernel")[1][:12] for n in stochastic) == 3
    assert len(sumsqs) == 3, names
    # The accumulation: the 15 pairs and roundings of the update, each with and without
    # reading the buffer (the first micro-batch: the third template argument).
    accumulates = [n for n in names if "grad_accumulate_kernel" in n]
    assert len(accumulates) == 30, names
    flags = [_template_flags(n) for n in accumulates]  # [first, stochastic]
    assert sum(first for first, _ in flags) == 15, accumulates
    assert sum(stochastic for _, stochastic in flags) == 12, accumulates


def test_bulk_uses_128_bit_memory_ops(ptx: str) -> None:
    for name, body in _kernels(ptx).items():
        assert re.search(r"ld\.global(\.nc)?\.v4\.", body), f"{name}: no 128-bit load"
        if "lomo_update_kernel" in name or "grad_accumulate_kernel" in name:
            assert re.search(r"st\.global\.v4\.", body), f"{name}: no 128-bit store"
            # The gradient is read-only: the non-coherent path.
            assert re.search(r"ld\.global\.nc\.v4\.", body), f"{name}: grad not via ld.nc"
        if "grad_accumulate_kernel" in name:
            # The buffer is read (coherent loads) except on the first micro-batch.
            first = _template_flags(name)[0]
            assert bool(re.search(r"ld\.global\.v4\.", body)) != first, name


def _template_flags(name: str) -> list[bool]:
    """The bool template arguments of a mangled kernel name, in order (Lb0E / Lb1E)."""
    return [flag == "1" for flag in re.findall(r"Lb([01])E", name)]


def test_no_local_memory(ptx: str) -> None:
    # Register spills or arrays indexed at run time would show up as .local.
    assert ".local" not in ptx


# ----------------------------------------------------------------------------- AdaLomo


@pytest.fixture(scope="module", params=ARCHS)
def adalomo_ptx(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("ptx") / f"adalomo_cuda_{request.param}.ptx"
    _nvcc(f"-arch={request.param}", "-ptx", "-o", str(out), source=ADALOMO_SOURCE)
    return out.read_text()


@pytest.mark.parametrize("arch", ARCHS)
def test_adalomo_object_builds_without_spills(arch: str, tmp_path: Path) -> None:
    out = tmp_path / "adalomo_cuda.o"
    log = _nvcc(f"-arch={arch}", "-c", "-Xptxas", "-v", "-o", str(out), source=ADALOMO_SOURCE)
    assert out.stat().st_size > 0
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores", log)
    assert len(frames) >= 52, log[-2000:]  # one line per kernel
    assert all(frame == ("0", "0") for frame in frames), log[-2000:]


def test_adalomo_write_back_kernels_instantiated(adalomo_ptx: str) -> None:
    # The write-back passes (factored and 1-D): the 9 param x grad dtype pairs rounding to
    # nearest, and the 6 with bf16 or fp16 params also stochastically (Lb1).
    names = list(_kernels(adalomo_ptx))
    for kernel in ("factored_apply_kernel", "vector_apply_kernel"):
        found = [n for n in names if kernel in n]
        assert len(found) == 15, (kernel, names)
        stochastic = [n for n in found if "Lb1E" in n]
        assert len(stochastic) == 6, (kernel, stochastic)
        assert not any("4Fp32E" in n.split(kernel)[1][:14] for n in stochastic), stochastic
    assert ".local" not in adalomo_ptx


# ----------------------------------------------------------------------------- 8-bit buffer


def test_int8_kernels_instantiated(ptx: str) -> None:
    names = list(_kernels(ptx))
    # The accumulation: each gradient dtype, with and without reading the buffer (first), its
    # codes to nearest or stochastically (any gradient dtype: codes are never exact).
    accumulates = [n for n in names if "grad_accumulate_int8_kernel" in n]
    assert len(accumulates) == 12, names
    flags = [_template_flags(n) for n in accumulates]  # [first, stochastic]
    assert sum(first for first, _ in flags) == 6, accumulates
    assert sum(stochastic for _, stochastic in flags) == 6, accumulates
    # The update: each parameter dtype, bf16 and fp16 also rounding stochastically.
    updates = [n for n in names if "lomo_update_int8_kernel" in n]
    assert len(updates) == 5, names
    stochastic = [n for n in updates if "Lb1E" in n]
    assert len(stochastic) == 2 and not any("4Fp32E" in n for n in stochastic), stochastic
    assert len([n for n in names if "int8_dequantize_kernel" in n]) == 3, names


def _int8_kernels(ptx_text: str) -> dict[str, str]:
    return {name: body for name, body in _kernels(ptx_text).items() if "int8" in name}


def test_int8_kernels_move_128_bit_vectors(ptx: str) -> None:
    for name, body in _int8_kernels(ptx).items():
        # Codes, parameters and dequantized values are stored 16 bytes at a time; the
        # read-only operand (the gradient, or the codes) comes on the non-coherent path.
        assert re.search(r"st\.global\.v4\.", body), f"{name}: no 128-bit store"
        assert re.search(r"ld\.global\.nc\.v4\.", body), f"{name}: no 128-bit ld.nc"
        coherent = bool(re.search(r"ld\.global\.v4\.", body))
        if "grad_accumulate_int8_kernel" in name:
            # The old codes are read (coherent: the kernel writes them) except on the first
            # micro-batch.
            assert coherent != _template_flags(name)[0], name
        elif "lomo_update_int8_kernel" in name:
            assert coherent, f"{name}: the parameter is not loaded 128 bits at a time"


def test_int8_accumulate_reduces_in_registers(ptx: str) -> None:
    """A block's largest magnitude is reduced by shuffles within its 16 threads (4 steps, the
    CTA's sum of squares 5 + 5 more), its scale comes from the bits (no division anywhere),
    and the sum of squares is one barrier and one atomic per CTA."""
    for name, body in _int8_kernels(ptx).items():
        assert not re.search(r"\b(div|rem)\.", body), f"{name}: a division"
        if "grad_accumulate_int8_kernel" in name:
            assert len(re.findall(r"\bshfl\.sync\.bfly\.b32", body)) == 4 + 5 + 5, name
            assert len(re.findall(r"\b(atom|red)\.global\.add\.f32", body)) == 1, name
            assert len(re.findall(r"\bbar\.sync\b", body)) == 1, name


def test_int8_constants_match_the_layout() -> None:
    """The C++ and CUDA kernels' block geometry and scale rule (csrc/int8_blocks.h, which
    both include) are core/int8_blocks.py's."""
    from lomo_kernels.core import int8_blocks

    header = (CSRC / "int8_blocks.h").read_text()

    def constant(pattern: str) -> int:
        found = re.search(pattern, header)
        assert found, pattern
        return int(found.group(1), 0)

    assert constant(r"kBlock = (\d+);") == int8_blocks.INT8_BLOCK
    assert constant(r"kMantissaLimit = (0x[0-9A-Fa-f]+)u;") == int8_blocks.INT8_MANTISSA_LIMIT
    assert constant(r"kMinExponent = (-\d+);") == int8_blocks.INT8_MIN_EXPONENT
    assert constant(r"kMaxCode = (\d+)\.0f;") == int8_blocks.INT8_MAX_CODE
    for source in (SOURCE, CSRC / "lomo_cpu.cpp", CSRC / "lomo_cuda_binding.cpp"):
        assert '#include "int8_blocks.h"' in source.read_text(), source.name
