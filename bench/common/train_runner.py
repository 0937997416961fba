"""One optimizer's training run, measured, in a process of its own.

`bench.train`, `bench.quality` and the demo call `measure_isolated` once per optimizer. A run
builds its workload (model and batches) with a seed, so every optimizer starts from the same
weights and sees the same batches, then times and meters each step:

- step time: forward + backward + update, `perf_counter` around the step (after a CUDA
  synchronize on GPUs), and the process's CPU time over the same span (`process_time`); the
  first `warmup` steps are left out of the medians (lazy state, first calls, compilation).
  The figure a table uses (`median_step_s`) is the CPU time for a one-thread run on the CPU,
  where it is the step's own work and a machine shared with other jobs does not inflate it;
  elsewhere the wall clock (`step_clock`).
- peak memory: on CUDA `max_memory_allocated()` (reset after the warm-up); on CPU the
  process's VmHWM (reset through /proc/self/clear_refs after the warm-up), in a fresh
  process started with MALLOC_MMAP_THRESHOLD_=65536 so freed blocks leave the RSS (method:
  MEASURING.md). "Above the model" subtracts the memory held once the model and the first
  batch exist, before the optimizer: the optimizer's state counts in the peak.
- out of memory is a result ("OOM"), not a crash: CUDA's OutOfMemoryError, a CPU
  allocation failure, or the process killed by the system.
- a memory cap (`spec["memory_cap_gib"]`, the size of a smaller GPU): on CUDA the caching
  allocator is capped (`set_per_process_memory_fraction`), so a step that needs more runs
  out of memory as it would there; on CPU a run whose peak is above the cap is reported as
  OOM after it ran (nothing enforces it).

A workload is a module with `build(spec: dict) -> Workload`; the spec travels to the child
process as JSON (`process.run_isolated`).
"""

from __future__ import annotations

import importlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .meter import MIB, Meter
from .optimizers import make_trainer, state_bytes
from .process import ProcessFailed, run_isolated

GIB = 2**30


@dataclass
class Workload:
    model: Any
    batches: Iterator[Any]  # endless: each item is the input ids (labels are the same ids)
    evaluate: Callable[[], float] | None = None  # a held-out loss, measured before and after
    # Builds a learning-rate scheduler on the optimizer (stepped after every step), or None.
    make_scheduler: Callable[[Any], Any] | None = None
    # Called after every optimizer step (e.g. a rounding applied to the weights), or None.
    after_step: Callable[[], None] | None = None


def step_clock(device: str, threads: int) -> str:
    """The clock of a run's step times: "cpu" (the process's CPU time) for one thread on the
    CPU, else "wall" (with threads the CPU time would add theirs up; a GPU's work is not the
    host's CPU time)."""
    return "cpu" if not device.startswith("cuda") and threads == 1 else "wall"


def _is_oom(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, torch.OutOfMemoryError | MemoryError) or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)
    )


def measure(
    workload_module: str,
    spec: dict[str, Any],
    optimizer: str,
    steps: int,
    warmup: int,
    lr: float,
    clip_grad_norm: float | None,
    progress: bool = False,
    options: dict[str, Any] | None = None,
    threads: int | None = None,
) -> dict[str, Any]:
    """Trains with `optimizer` in this process; its figures (see the module docstring).
    `options`: keyword arguments of the optimizer's constructor (`make_trainer`); `threads`:
    torch's CPU threads (default: as they are)."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    device = spec.get("device", "cpu")
    cap_gib = spec.get("memory_cap_gib")
    if cap_gib is not None and device.startswith("cuda"):
        cap_cuda_memory(device, cap_gib)
    meter = Meter(device)
    result: dict[str, Any] = {"optimizer": optimizer, "status": "ok", "lr": lr}
    try:
        work = importlib.import_module(workload_module).build(spec)
        params = list(work.model.parameters())
        result["num_parameters"] = sum(p.numel() for p in params)
        result["model_mib"] = sum(p.numel() * p.element_size() for p in params) / MIB
        if work.evaluate is not None:
            result["loss_before"] = work.evaluate()
        first = next(work.batches).to(device)
        baseline = meter.current()
        trainer = make_trainer(optimizer, work.model, lr, clip_grad_norm, options)
        result.update(trainer.notes)
        scheduler = work.make_scheduler and work.make_scheduler(trainer.optimizer)
        losses, times, cpu_times = [], [], []
        ids = first
        bar = _progress(optimizer, steps) if progress else None
        # A run shorter than its warm-up (a smoke test) measures its last step.
        warmup = min(warmup, steps - 1)
        for i in range(steps):
            if i == warmup:
                meter.reset_peak()
            if i > 0:
                ids = next(work.batches).to(device)
            began, began_cpu = time.perf_counter(), time.process_time()
            loss = trainer.step(ids, ids)
            if device.startswith("cuda"):
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - began)
            cpu_times.append(time.process_time() - began_cpu)
            losses.append(float(loss.detach()))
            if work.after_step is not None:
                work.after_step()
            if scheduler is not None:
                scheduler.step()
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"loss {losses[-1]:.3f}, {times[-1] * 1e3:.0f} ms/step")
        if bar is not None:
            bar.close()
        if hasattr(trainer.optimizer, "flush_report"):
            trainer.optimizer.flush_report()
        peak = meter.peak()
    except Exception as exc:
        if not _is_oom(exc):
            raise
        return result | {"status": "OOM", "error": str(exc).splitlines()[0][:300]}
    clock = step_clock(device, torch.get_num_threads())
    wall, cpu = statistics.median(times[warmup:]), statistics.median(cpu_times[warmup:])
    median = cpu if clock == "cpu" else wall
    result |= {
        "losses": losses,
        "step_s": times,
        "cpu_step_s": cpu_times,
        "step_clock": clock,
        "median_wall_step_s": wall,
        "median_cpu_step_s": cpu,
        "median_step_s": median,
        "tokens_per_step": first.numel(),
        "tokens_per_s": first.numel() / median,
        "peak_mib": peak / MIB,
        "peak_above_model_mib": (peak - baseline) / MIB,
        "state_mib": state_bytes(trainer.optimizer) / MIB,
        "threads": torch.get_num_threads(),
    }
    if work.evaluate is not None:
        result["loss_after"] = work.evaluate()
    # CPU: the cap compared after the run (on CUDA the capped allocator enforced it).
    if cap_gib is not None and not meter.cuda and peak > cap_gib * GIB:
        return result | {
            "status": "OOM",
            "error": f"peak {peak / MIB:,.0f} MiB above the {cap_gib:g} GiB cap (VmHWM)",
        }
    return result


def cap_cuda_memory(device: str, gib: float) -> None:
    """Makes this process's CUDA caching allocator raise OutOfMemoryError beyond `gib` GiB,
    as a GPU with that much memory would (the CUDA context, ~0.5 GiB, is not counted)."""
    import torch

    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    total = torch.cuda.get_device_properties(index).total_memory
    if gib * GIB > total:
        raise ValueError(
            f"memory cap {gib:g} GiB is above this GPU's {total / GIB:.1f} GiB: it caps nothing"
        )
    torch.cuda.set_per_process_memory_fraction(gib * GIB / total, index)


def _progress(name: str, steps: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=steps, desc=f"{name:>14}", unit="step", file=sys.stderr)


def measure_isolated(
    workload_module: str,
    spec: dict[str, Any],
    optimizer: str,
    *,
    steps: int,
    warmup: int = 1,
    lr: float,
    clip_grad_norm: float | None = 1.0,
    threads: int = 1,
    progress: bool = False,
    timeout: float | None = None,
    options: dict[str, Any] | None = None,
    metered: bool = True,
) -> dict[str, Any]:
    """`measure` in a fresh interpreter with the malloc setting; its result, "OOM" where the
    system killed it.

    With `progress`, the child's progress bar goes to this process's stderr; otherwise its
    stderr is kept and shown if it fails. `metered=False`: without the malloc setting, for a
    run whose peak memory is not used (its figure is then not exact: MEASURING.md); faster.
    """
    arguments = dict(locals())  # this function's parameters: measure's, and two of its own
    del arguments["timeout"], arguments["metered"]
    try:
        return run_isolated(
            measure,
            arguments,
            metered=metered,
            stderr_through=progress,
            timeout=timeout,
            what=optimizer,
        )
    except ProcessFailed as exc:
        if not exc.killed:  # SIGKILL: the system's out-of-memory killer
            raise
        return {"optimizer": optimizer, "status": "OOM", "error": "killed (SIGKILL)"}
