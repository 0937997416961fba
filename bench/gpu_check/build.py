"""``python -m bench.gpu_check.build --device cuda --json F``: the C++/CUDA
extensions of both op families built for one device, at once, and whether Triton serves it.

On a fresh GPU machine each CUDA extension is a minute or more of nvcc; built here side by
side, before the tests start, they are found built by every test process after
(torch.utils.cpp_extension caches them). Writes the seconds it took and, per backend, why
it is unavailable where it is.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any


def build(device: str) -> dict[str, Any]:
    """{"seconds": the build's wall time, "unavailable": {backend: why}} for `device`."""
    import torch

    from lomo_kernels.ops import backends

    device_type = torch.device(device).type
    loads = {
        "LOMO cpp": (backends.LOMO, "cpp"),
        "AdaLomo cpp": (backends.ADALOMO, "cpp"),
        "triton": (backends.LOMO, "triton"),
    }
    began = time.perf_counter()
    with ThreadPoolExecutor(len(loads)) as pool:
        futures = {
            name: pool.submit(registry.load, backend, device_type)
            for name, (registry, backend) in loads.items()
        }
        reasons = {name: future.result()[1] for name, future in futures.items()}
    return {
        "device": device,
        "seconds": time.perf_counter() - began,
        "unavailable": {name: reason for name, reason in reasons.items() if reason},
    }


def parser() -> argparse.ArgumentParser:
    arguments = argparse.ArgumentParser(
        description="build the C++/CUDA extensions for one device, both at once"
    )
    arguments.add_argument("--device", default="cuda", help="cuda or cpu (default cuda)")
    arguments.add_argument("--json", required=True, help="write the result here")
    return arguments


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    result = build(args.device)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
