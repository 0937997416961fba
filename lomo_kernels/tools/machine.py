"""What a figure was measured on: device, threads, versions, date (written next to results)."""

from __future__ import annotations

import datetime
import json
import os
import platform
from typing import Any


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (as `lscpu` prints it), else the platform's."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    """The instruction-set flags of /proc/cpuinfo (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def vector_isa() -> str:
    """The widest matrix/vector extension the CPU has, as a short name for logs and tables."""
    flags = cpu_flags()
    for flag, name in (
        ("amx_bf16", "AMX"),
        ("avx512_bf16", "AVX-512 BF16"),
        ("avx512f", "AVX-512"),
        ("avx2", "AVX2"),
    ):
        if flag in flags:
            return name
    return platform.machine()


def native_bf16_matmul(device: str = "cpu") -> bool:
    """Whether bf16 matmuls run natively on `device`.

    Every CUDA GPU we run on does. On x86 CPUs without AVX-512 BF16 or AMX (e.g. AVX2-only
    AMD Zen 3) torch falls back to a generic GEMM: about 40x slower than fp32 and holding an
    fp32 copy of an operand, so bf16 runs there are neither fast nor representative of memory.
    """
    from ..core.torch_internals import mkldnn_bf16_supported

    if not str(device).startswith("cpu"):
        return True
    return mkldnn_bf16_supported()


def fast_dtype(device: str = "cpu") -> str:
    """ "bf16" where bf16 matmuls are native on `device`, else "fp32" (see native_bf16_matmul)."""
    return "bf16" if native_bf16_matmul(device) else "fp32"


def describe(device: str = "cpu") -> dict[str, Any]:
    """Machine, device, threads and library versions, for a results file's header."""
    import torch

    info: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "device": device,
        "cpu": cpu_model(),
        "cpu_isa": vector_isa(),
        "cpu_cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.startswith("cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.device(device))
        info["gpu"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["cuda"] = torch.version.cuda
    return info


def one_line(info: dict[str, Any]) -> str:
    """The header line printed above a table."""
    where = (
        f"GPU {info['gpu']} ({info['gpu_memory_gib']} GiB), CUDA {info['cuda']}"
        if "gpu" in info
        else f"CPU {info['cpu']} ({info.get('cpu_isa', '?')}), {info['cpu_cores']} cores, "
        f"{info['threads']} threads"
    )
    return (
        f"{where}; torch {info['torch']}, triton {info['triton']}, python {info['python']}; "
        f"{info['date']}"
    )


def print_results(meta: dict[str, Any], table: str, json_path: str | None, **results: Any) -> None:
    """A benchmark's output: the machine line and the table; with `json_path`, the machine
    and `results` (by name) as JSON there too."""
    print(one_line(meta))
    print(table)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"machine": meta, **results}, f, indent=1)
