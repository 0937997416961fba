"""What a figure was measured on: device, threads, versions, date (written next to results)."""

from __future__ import annotations

import datetime
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


def describe(device: str = "cpu") -> dict[str, Any]:
    """Machine, device, threads and library versions, for a results file's header."""
    import torch

    info: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "device": device,
        "cpu": cpu_model(),
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
        else f"CPU {info['cpu']}, {info['cpu_cores']} cores, {info['threads']} threads"
    )
    return (
        f"{where}; torch {info['torch']}, triton {info['triton']}, python {info['python']}; "
        f"{info['date']}"
    )
