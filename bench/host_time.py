"""Host time of one LOMO update call on a small tensor, the ways a program makes it.

    python bench/host_time.py [--device cpu|cuda] [--numel N] [--dtype bf16|fp16|fp32]
        [--backend cpp|triton|torch] [--reps R] [--calls C]

Rows, timed interleaved in one process (MEASURING.md: ratios from one run):
  public (name)      ops.fused_lomo_update_(..., backend="<name>"): every argument checked
                     and converted, the backend resolved by name
  public (module)    the same with a backend module resolved once (ops.backends.resolve)
  Lomo per tensor    what Lomo runs for one parameter inside backward (Lomo._apply)
  AdaLomo per tensor the same for AdaLomo (AdaLomo._update: its passes, several op calls)
  kernel alone       the backend's kernel called as the eager fast path calls it, with the
                     public call's arguments: the floor of any call through lomo_kernels
  p.add_             torch's own in-place axpy, the floor of one eager call

A row is the minimum over R repetitions of C back-to-back calls (CUDA: synchronised at the
end of each repetition, so the figure is the host's enqueue rate once the queue is full).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lomo_kernels import AdaLomo, Lomo  # noqa: E402
from lomo_kernels.ops import fused_lomo_update_  # noqa: E402
from lomo_kernels.ops.backends import resolve  # noqa: E402
from lomo_kernels.ops.lomo import LOMO_UPDATE, lomo_update_op  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def lomo_per_tensor(param: torch.Tensor, backend: str) -> Callable[[], None]:
    """Lomo's update of `param` as its hook makes it, after one real step set it up."""
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(param)
    optimizer = Lomo(model, lr=1e-3, clip_grad_norm=None, backend=backend)
    optimizer.fused_backward(model.weight.float().pow(2).sum(), lr=1e-3)
    group = optimizer._hook_groups[0]
    scalars = optimizer._scalars[param.device]
    grad = torch.randn_like(param)
    weight = model.weight
    return lambda: optimizer._apply(
        weight, weight, 0, grad, group, scalars, scalars.update_found_inf
    )


def adalomo_per_tensor(param: torch.Tensor, backend: str) -> Callable[[], None]:
    """AdaLomo's update of `param` (as a 64-row matrix where its size allows: the factored
    statistics, its passes over rows and columns) as its hook makes it, after one real step."""
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(param.view(64, -1) if param.numel() % 64 == 0 else param)
    optimizer = AdaLomo(model, lr=1e-3, clip_grad_norm=None, backend=backend)
    optimizer.fused_backward(model.weight.float().pow(2).sum(), lr=1e-3)
    group = optimizer._hook_groups[0]
    scalars = optimizer._scalars[param.device]
    weight = model.weight
    grad = torch.randn_like(weight)
    return lambda: optimizer._update(weight, grad, group, scalars, scalars.update_found_inf)


def kernel_alone(
    module: object, param: torch.Tensor, grad: torch.Tensor, lr: torch.Tensor, flag: torch.Tensor
) -> Callable[[], None]:
    """The kernel the fast path runs for `module`, given what the public call below passes
    (its floats converted as the public function converts them)."""
    kernel = lomo_update_op._kernel(module, param.device.type)
    given = {"param": param, "grad": grad, "lr": lr, "found_inf": flag, "skip_if": flag}
    defaults = {"weight_decay": 0.0, "stochastic_rounding": False, "seed": 0}
    args = tuple(given.get(name, defaults.get(name)) for name in LOMO_UPDATE.names)
    return lambda: kernel(*args)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--numel", type=int, default=4096)
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--backend", default="cpp", choices=["cpp", "triton", "torch"])
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    param = torch.randn(args.numel, dtype=dtype, device=device)
    grad = torch.randn_like(param)
    lr = torch.full((1,), 1e-3, device=device)
    flag = torch.zeros(1, device=device)
    module = resolve(device, args.backend)

    def public(backend: object) -> Callable[[], None]:
        return lambda: fused_lomo_update_(
            param, grad, lr=lr, found_inf=flag, skip_if=flag, backend=backend
        )

    rows = {
        "public (name)": public(args.backend),
        "public (module)": public(module),
        "Lomo per tensor": lomo_per_tensor(param.clone(), args.backend),
        "AdaLomo per tensor": adalomo_per_tensor(param.clone(), args.backend),
        "kernel alone": kernel_alone(module, param, grad, lr, flag),
        "p.add_": lambda: param.add_(grad, alpha=-1e-3),
    }
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = dict.fromkeys(rows, float("inf"))
    with torch.no_grad():  # as inside backward: nothing records these calls
        for _ in range(args.reps):
            for name, call in rows.items():
                sync()
                start = time.perf_counter()
                for _ in range(args.calls):
                    call()
                sync()
                best[name] = min(best[name], (time.perf_counter() - start) / args.calls)
    print(
        f"host time per call: {args.numel} {args.dtype} on {args.device}, backend "
        f"{args.backend}, torch {torch.__version__}, 1 thread"
    )
    for name, seconds in best.items():
        ratio = seconds / best["p.add_"]
        print(f"  {name:18s} {seconds * 1e6:7.2f} us  {ratio:5.2f}x p.add_")


if __name__ == "__main__":
    main()
