"""What `bench.zero3` and `bench.fsdp2` share: the model, the ranks' measured steps, the launch.

Each configuration runs on 2 ranks in fresh processes (`process.run_isolated(..., ranks=2)`:
torchrun, gloo on CPU, NCCL on GPUs, one thread per rank). Every step starts on all ranks
together (a barrier); step 0 is not measured (lazy state, first-call allocations). Per rank
and step: its seconds and, where metered, its peak (`meter`: VmHWM reset before the step on
CPU, the allocator's peak on CUDA) above the rank's baseline. A step's time is the slower
rank's. MiB = 2**20 bytes.

Model: a transformers LLaMA (hidden 512, intermediate 1408, 4 layers, 8 heads, vocab 32000:
45.6M parameters), random weights.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from .meter import MIB, Meter
from .models import ModelShape
from .process import run_isolated
from .timing import synchronize

MODEL = ModelShape("llama-46m", 32000, 512, 1408, 4, 8, 8)
RANKS = 2
TIMEOUT_S = 1800


def measure_steps(
    step: Callable[[], None], steps: int, device: str, meter: Meter | None, baseline: int
) -> dict[str, list[float]]:
    """This rank's seconds per step after step 0 and, with `meter`, its peaks above
    `baseline` (MiB)."""
    import torch.distributed as dist

    seconds, peaks = [], []
    for i in range(steps):
        dist.barrier()
        if meter is not None:
            meter.reset_peak()
        start = time.perf_counter()
        step()
        synchronize(device)
        elapsed = time.perf_counter() - start
        if i > 0:
            seconds.append(elapsed)
            if meter is not None:
                peaks.append((meter.peak() - baseline) / MIB)
    return {"step_s": seconds, "peak_mib": peaks}


def gathered(result: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Every rank's `result` on rank 0 (None on the others); the process group ends here."""
    import torch.distributed as dist

    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, result)
    rank = dist.get_rank()
    dist.barrier()
    dist.destroy_process_group()
    return everyone if rank == 0 else None


def launch(rank_main: Callable[..., Any], metered: bool, **kwargs: Any) -> list[dict[str, Any]]:
    """`rank_main(metered=metered, **kwargs)` on every rank, in fresh processes (with the
    malloc setting when `metered`): each rank's result."""
    return run_isolated(
        rank_main,
        kwargs | {"metered": metered},
        metered=metered,
        ranks=RANKS,
        env={"OMP_NUM_THREADS": "1"},
        timeout=TIMEOUT_S,
        what=f"{kwargs.get('config', rank_main.__name__)} on {RANKS} ranks",
    )


def step_seconds(ranks: Sequence[dict[str, Any]]) -> float:
    """The median over steps of the slower rank's time."""
    per_step = zip(*(r["step_s"] for r in ranks), strict=True)
    return statistics.median(max(ranks_seconds) for ranks_seconds in per_step)
