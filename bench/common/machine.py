"""What a figure was measured on: device, threads, versions, date (written next to results).

The CPU's name, vector level and bf16 support come from the package's environment report
(lomo_kernels/tools/env.py), importable from here.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from typing import Any

from lomo_kernels.tools.env import cpu_model, native_bf16_matmul, vector_isa

__all__ = [
    "cpu_model",
    "describe",
    "fast_dtype",
    "native_bf16_matmul",
    "one_line",
    "print_results",
    "vector_isa",
]


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
        "bf16_matmul_native": native_bf16_matmul("cpu"),
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
        f"{info['threads']} threads, bf16 matmul {_bf16_matmul(info)}"
    )
    return (
        f"{where}; torch {info['torch']}, triton {info['triton']}, python {info['python']}; "
        f"{info['date']}"
    )


def _bf16_matmul(info: dict[str, Any]) -> str:
    """How torch runs bf16 matmuls here: the CPU's flags may offer AVX-512 BF16 while a cap
    (ONEDNN_MAX_CPU_ISA) or the CPU itself leaves torch its generic fallback."""
    native = info.get("bf16_matmul_native")
    return "?" if native is None else ("native" if native else "emulated")


def print_results(meta: dict[str, Any], table: str, json_path: str | None, **results: Any) -> None:
    """A benchmark's output: the machine line and the table; with `json_path`, the machine
    and `results` (by name) as JSON there too."""
    print(one_line(meta))
    print(table)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"machine": meta, **results}, f, indent=1)
