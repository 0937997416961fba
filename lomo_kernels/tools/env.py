"""`lomo-kernels env`: what this machine runs the package with, in one report.

    lomo-kernels env [--json]

Versions (Python, torch, Triton, CUDA), the CPU and its vector level, whether bf16 matmuls
are native on it, and for each device here which backends of the fused updates load (the
C++ extensions build on first use: the first report can take a minute or two), with the
reason for each that does not. Paste it into a bug report.
"""

from __future__ import annotations

import argparse
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


def _version(name: str) -> str | None:
    try:
        module = __import__(name)
    except Exception:  # not installed, or broken: the report says so instead of failing
        return None
    return getattr(module, "__version__", "?")


def backends(device_type: str) -> dict[str, dict[str, str]]:
    """family -> backend -> "loads" or the reason it does not, for `device_type`, in the
    order the package tries them there."""
    from ..ops import backends as registry

    report = {}
    for family, backends_of in (("lomo", registry.LOMO), ("adalomo", registry.ADALOMO)):
        report[family] = {}
        for name in registry.auto_order(device_type):
            module, reason = backends_of.load(name, device_type)
            report[family][name] = "loads" if module is not None else reason
    return report


def report() -> dict[str, Any]:
    """The environment report as a dict (what --json prints)."""
    import torch

    cuda = torch.cuda.is_available()
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "cuda": torch.version.cuda,
        "cuda_available": cuda,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "cpu": cpu_model(),
        "cpu_isa": vector_isa(),
        "cpu_cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "bf16_matmul_native_on_cpu": native_bf16_matmul("cpu"),
        "backend_env": os.environ.get("LOMO_KERNELS_BACKEND"),
        "backends": {"cpu": backends("cpu")},
    }
    if cuda:
        info["backends"]["cuda"] = backends("cuda")
    return info


def format_report(info: dict[str, Any]) -> str:
    bf16 = (
        "native"
        if info["bf16_matmul_native_on_cpu"]
        else "emulated (about 40x slower than fp32: prefer fp32 weights on this CPU)"
    )
    lines = [
        f"python {info['python']}, torch {info['torch']}, triton {info['triton'] or 'missing'}",
        f"CUDA {info['cuda'] or 'none (a CPU build of torch)'}"
        + (f", device: {info['gpu']}" if info["gpu"] else ", no device here"),
        f"CPU {info['cpu']} ({info['cpu_isa']}), {info['cpu_cores']} cores, "
        f"{info['threads']} threads; bf16 matmul {bf16}",
    ]
    if info["backend_env"]:
        lines.append(f"LOMO_KERNELS_BACKEND={info['backend_env']}")
    for device, families in info["backends"].items():
        for family, loaded in families.items():
            parts = [
                name if status == "loads" else f"{name}: no ({status})"
                for name, status in loaded.items()
            ]
            lines.append(f"{device} {family} backends, in order: " + "; ".join(parts))
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def command(args: argparse.Namespace) -> int:
    info = report()
    print(json.dumps(info) if args.json else format_report(info))
    return 0
