"""Timings of the fused LOMO update against its baselines, per size and dtype.

    python -m bench.kernels [--device cpu|cuda] [--dtype bf16,fp16,fp32] [--sizes 4K,1M,64M]
                               [--csv F] [--json F] [--plot F.png]

Every case updates parameters in place with gradients of the same dtype. Variants:

  lomo_kernels[B]  `ops.fused_sgd_update_` on backend B with the full LOMO option set, all
                   non-neutral: unscale by a device-tensor loss scale, clip by value, a
                   clip_coef tensor, weight decay and inf/nan detection, one pass
  lomo_kernels[B]+sr  the same with stochastic rounding (bf16, fp16: the optimizers'
                   default), the per-step seed a device value; a line per dtype gives its
                   time over round-to-nearest's, per case
  lomo_optim       lomo-optim 0.1.1's per-parameter op chain (to fp32, div, clamp, mul,
                   param to fp32, mul, add, copy back)
  lomo_optim+compile  the same chain under `torch.compile` (dynamic shapes: one compilation)
  torch_fused_sgd  `torch._fused_sgd_` (plain SGD: no unscale, clip or check)
  axpy_floor       `p.add_(g, alpha=-lr)`: the same bytes moved (read p and g, write p)

Method (MEASURING.md): one process, variants timed interleaved within each
repetition (A, B, C, A, B, C, ...), an untimed pass over the data before every timed call
(the same cache state for each; on CUDA a 256 MiB buffer is overwritten to flush L2),
medians. `x floor` = median / median(axpy_floor) of the same case and run. GB/s = bytes moved
(param read + grad read + param write) / median time. On CUDA the time is the device's: a spin
kernel keeps the GPU busy while the host enqueues the call (the spin doubles until the host
finishes first), so events bracket the kernels, not the launch overhead; the host's enqueue
time per tensor is reported on its own row. `% copy` compares GB/s with a device-to-device copy
of 256 MiB timed in the same run. CPU figures are CPU figures: never read them as GPU timings.

Cases: sizes 4K to 64M elements (one tensor) and the parameter mix of one LLaMA-7B decoder
layer (4 x 4096^2, 3 x 4096 x 11008, 2 x 4096; one call per tensor, as the hooks do).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from lomo_kernels import ops
from lomo_kernels.ops import backends

from .common import machine
from .common.argtypes import (
    add_counts,
    add_device_argument,
    add_list_argument,
    from_value_errors,
    output_path,
    plot_path,
    positive_float,
)
from .common.dtypes import DTYPES
from .common.models import PRESETS
from .common.progress import with_progress
from .common.timing import DeviceClock, time_interleaved
from .common.torch_internals import torch_fused_sgd

LR = 1e-3
WEIGHT_DECAY = 0.01
CLIP_VALUE = 1.0
INV_SCALE = 2.0**-10  # a dynamic loss scale of 1024
CLIP_COEF = 0.8  # as clip-by-norm computes it on the device
DEFAULT_SIZES = tuple(4096 * 4**k for k in range(8))  # 4K .. 64M
LAYER_CASE = "llama-7b-layer"
FLOOR = "axpy_floor"
# The pure-PyTorch reference allocates fp32 copies of every tensor (tens of ms per million
# elements on a CPU): above this size it is left out on CPU to keep a run to minutes.
CPU_REFERENCE_MAX_NUMEL = 2**20
COPY_NUMEL_BYTES = 256 * 2**20


def parse_size(text: str) -> int:
    """'4K' -> 4096, '64M' -> 67108864, '1000' -> 1000."""
    text = text.strip().upper()
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    digits = text[:-1] if scale != 1 else text
    try:
        value = int(digits) * scale
    except ValueError:
        raise ValueError(f"bad size {text!r}: use e.g. 4096, 4K, 16M") from None
    if value <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return value


def parse_sizes(text: str) -> list[int]:
    """'4K,1M' -> [4096, 1048576]."""
    sizes = [parse_size(s) for s in text.split(",") if s.strip()]
    if not sizes:
        raise ValueError(f"no size in {text!r}: use e.g. 4K,1M")
    return sizes


def size_label(numel: int) -> str:
    for unit, scale in (("M", 2**20), ("K", 2**10)):
        if numel % scale == 0:
            return f"{numel // scale}{unit}"
    return str(numel)


def add_sizes_argument(parser: argparse.ArgumentParser, default: Sequence[int]) -> None:
    """--sizes: a comma list of element counts (4K, 1M, ...)."""
    text = ",".join(size_label(n) for n in default)
    parser.add_argument(
        "--sizes",
        type=from_value_errors(parse_sizes),
        default=text,
        help=f"comma list of element counts (4K, 1M, ...; default {text})",
    )


def llama_layer_numels(model: str = "llama-7b") -> list[int]:
    """numel of each parameter of one decoder layer of a preset."""
    return PRESETS[model].layer_tensor_numels()


def case_numels(name: str) -> list[int]:
    """The tensors of a case by its name: LAYER_CASE, or one tensor of a size ('4K')."""
    return llama_layer_numels() if name == LAYER_CASE else [parse_size(name)]


def official_chain(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
    """lomo_optim.Lomo's update, per parameter (loss scale and clip_coef neutral, so that the
    in-place grad ops do not drift the data between repetitions; the ops cost the same)."""
    for p, g in zip(params, grads, strict=True):
        grad_fp32 = g.to(torch.float32)
        grad_fp32.div_(1.0)
        grad_fp32.clamp_(min=-CLIP_VALUE, max=CLIP_VALUE)
        grad_fp32.mul_(1.0)
        p_fp32 = p.to(torch.float32)
        p_fp32.mul_(1.0 - LR * WEIGHT_DECAY)
        p_fp32.add_(grad_fp32, alpha=-LR)
        p.copy_(p_fp32)


def fused_sgd_writes_params(dtype: torch.dtype, device: str = "cpu") -> bool:
    """Whether torch._fused_sgd_ updates every element of a `dtype` parameter.

    torch 2.13's CPU kernel skips the write-back of whole SIMD blocks for bf16/fp16
    (pytorch issue 191763); its timing is then that of a kernel moving a third fewer bytes.
    """
    param = torch.ones(1000, dtype=dtype, device=device)
    grad = torch.ones(1000, dtype=dtype, device=device)
    fused_sgd([param], [grad])
    return bool((param == 0.5).all())


def fused_sgd(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    lr: float = 0.5,
    weight_decay: float = 0.0,
    **amp: torch.Tensor,
) -> None:
    """torch._fused_sgd_ per parameter (plain SGD; `amp`: its grad_scale and found_inf)."""
    fused = torch_fused_sgd()
    for p, g in zip(params, grads, strict=True):
        fused(
            [p],
            [g],
            [],
            weight_decay=weight_decay,
            momentum=0.0,
            lr=lr,
            dampening=0.0,
            nesterov=False,
            maximize=False,
            is_first_step=False,
            **amp,
        )


def available_backends(device: str) -> list[str]:
    """Backends that really serve `device` tensors here (no silent fallback), fastest first.

    Triton on CPU runs only through its interpreter: timing that is meaningless, so CPU
    runs leave it out.
    """
    names = []
    dev = torch.device(device)
    for name in backends.BACKEND_NAMES:
        if dev.type == "cpu" and name == "triton":
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            if backends.backend_name(backends.resolve(dev, name)) == name:
                names.append(name)
    return names


class Case:
    """Parameters and gradients of one case, and the variants that update them in place."""

    def __init__(self, name: str, numels: Sequence[int], dtype: torch.dtype, device: str) -> None:
        gen = torch.Generator().manual_seed(0)
        self.name = name
        self.numels = list(numels)
        self.device = device
        self.params = [torch.randn(n, generator=gen).to(device, dtype) for n in self.numels]
        self.grads = [(torch.randn(n, generator=gen) * 1e-2).to(device, dtype) for n in numels]
        opts = {"dtype": torch.float32, "device": device}
        self.found_inf = torch.zeros(1, **opts)
        self.inv_scale = torch.full((1,), INV_SCALE, **opts)
        self.clip_coef = torch.full((1,), CLIP_COEF, **opts)
        self.lr = torch.full((1,), LR, **opts)
        self.element_size = self.params[0].element_size()

    @property
    def numel(self) -> int:
        return sum(self.numels)

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [*self.params, *self.grads]

    @property
    def bytes_moved(self) -> int:
        """Read param, read grad, write param."""
        return 3 * self.numel * self.element_size

    def ours(self, backend: str, stochastic: bool = False) -> Callable[[], None]:
        """The fused update with `backend`; `stochastic`: with stochastic rounding (the
        optimizers' default for bf16 and fp16 parameters), the per-step seed a device value."""
        seed_step = torch.zeros(1, dtype=torch.int64, device=self.device) if stochastic else None

        def run() -> None:
            for i, (p, g) in enumerate(zip(self.params, self.grads, strict=True)):
                ops.fused_sgd_update_(
                    p,
                    g,
                    lr=self.lr,
                    inv_scale=self.inv_scale,
                    clip_value=CLIP_VALUE,
                    clip_coef=self.clip_coef,
                    weight_decay=WEIGHT_DECAY,
                    found_inf=self.found_inf,
                    stochastic_rounding=stochastic,
                    seed=i,
                    seed_step=seed_step,
                    backend=backend,
                )

        return run

    def variants(self, backend_names: Sequence[str], compile_chain: bool) -> dict[str, Callable]:
        out: dict[str, Callable[[], None]] = {}
        for name in backend_names:
            if name == "torch" and self.device == "cpu" and self.numel > CPU_REFERENCE_MAX_NUMEL:
                continue
            out[f"lomo_kernels[{name}]"] = self.ours(name)
            if self.element_size == 2 and name != "torch":
                out[f"lomo_kernels[{name}]+sr"] = self.ours(name, stochastic=True)
        out["lomo_optim"] = lambda: official_chain(self.params, self.grads)
        if compile_chain:
            compiled = compiled_official_chain()
            out["lomo_optim+compile"] = lambda: compiled(self.params, self.grads)
        out["torch_fused_sgd"] = lambda: fused_sgd(self.params, self.grads, LR)
        out[FLOOR] = self.axpy
        return out

    def axpy(self) -> None:
        for p, g in zip(self.params, self.grads, strict=True):
            p.add_(g, alpha=-LR)


_COMPILED: dict[str, Callable] = {}


def compiled_official_chain() -> Callable:
    """One torch.compile of the official chain per single tensor (dynamic shapes)."""
    if "chain" not in _COMPILED:
        one = torch.compile(lambda p, g: official_chain([p], [g]), dynamic=True)

        def run(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
            for p, g in zip(params, grads, strict=True):
                one(p, g)

        _COMPILED["chain"] = run
    return _COMPILED["chain"]


def copy_bandwidth(device: str, reps: int = 20) -> float:
    """GB/s of a device-to-device copy of 256 MiB (read + write counted)."""
    src = torch.empty(COPY_NUMEL_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    clock = DeviceClock(device)
    median = time_interleaved({"copy": lambda: dst.copy_(src)}, reps, clock)["copy"]
    return 2 * src.numel() / median / 1e9


@dataclass
class Row:
    case: str
    numel: int
    dtype: str
    variant: str
    median_ms: float
    gb_per_s: float
    x_floor: float
    pct_copy: float | None
    host_us_per_tensor: float
    note: str = ""


def _reps_for(
    fns: dict[str, Callable[[], None]], clock: DeviceClock, budget_s: float, max_reps: int
) -> int:
    slowest = max(clock.time(fn) for fn in fns.values())
    return max(5, min(max_reps, int(budget_s / max(slowest, 1e-6) / len(fns))))


def run(
    device: str = "cpu",
    dtypes: Sequence[str] = tuple(DTYPES),
    sizes: Sequence[int] = DEFAULT_SIZES,
    layer_case: bool = True,
    compile_chain: bool = True,
    budget_s: float = 1.5,
    max_reps: int = 51,
    progress: bool = True,
) -> tuple[list[Row], dict[str, Any]]:
    """All cases; returns the rows and the run's metadata (machine, copy bandwidth)."""
    names = available_backends(device)
    clock = DeviceClock(device)
    meta = machine.describe(device)
    meta["backends"] = names
    copy_gbps = copy_bandwidth(device) if clock.cuda else None
    meta["copy_gb_per_s"] = copy_gbps
    names_of_cases = [size_label(n) for n in sizes] + ([LAYER_CASE] if layer_case else [])
    cases = [(name, case_numels(name)) for name in names_of_cases]
    jobs = [(d, c) for d in dtypes for c in cases]
    rows: list[Row] = []
    broken = {d for d in dtypes if not fused_sgd_writes_params(DTYPES[d], device)}
    meta["fused_sgd_skips_writes"] = sorted(broken)
    for dtype_name, (case_name, numels) in with_progress(
        jobs, progress, "bench kernels", "case", name=lambda job: f"{job[0]} {job[1][0]}"
    ):
        case = Case(case_name, numels, DTYPES[dtype_name], device)
        fns = case.variants(names, compile_chain)
        reps = _reps_for(fns, clock, budget_s, max_reps)
        host: dict[str, float] = {}
        settle = lambda _name, tensors=case.tensors: clock.settle(tensors)
        medians = time_interleaved(fns, reps, clock, settle=settle, host=host)
        floor = medians[FLOOR]
        for variant, t in medians.items():
            gbps = case.bytes_moved / t / 1e9
            note = (
                "skips bf16/fp16 writes (pytorch#191763)"
                if (variant == "torch_fused_sgd" and dtype_name in broken)
                else ""
            )
            rows.append(
                Row(
                    case=case_name,
                    numel=case.numel,
                    dtype=dtype_name,
                    variant=variant,
                    median_ms=t * 1e3,
                    gb_per_s=gbps,
                    x_floor=t / floor,
                    pct_copy=100 * gbps / copy_gbps if copy_gbps else None,
                    host_us_per_tensor=1e6 * host[variant] / len(numels),
                    note=note,
                )
            )
        del case, fns
    meta["unisolated_calls"] = clock.unisolated
    return rows, meta


def format_table(rows: Sequence[Row], meta: dict[str, Any]) -> str:
    """Per dtype: one line per case, `x floor` of each variant and GB/s of ours."""
    gpu = bool(meta.get("gpu"))
    what = "GPU device time (kernels only, launch overhead hidden)" if gpu else "CPU timings"
    lines = [
        machine.one_line(meta),
        f"{what}, medians of interleaved repetitions; "
        "cells: time / time(axpy_floor) of the same case, then GB/s",
    ]
    if meta.get("unisolated_calls"):
        lines.append(
            f"{meta['unisolated_calls']} timed calls synchronized with the host: their times "
            "include host time"
        )
    if meta.get("copy_gb_per_s"):
        lines.append(f"device-to-device copy: {meta['copy_gb_per_s']:.0f} GB/s")
    if meta.get("fused_sgd_skips_writes"):
        lines.append(
            "torch._fused_sgd_ leaves "
            + ", ".join(meta["fused_sgd_skips_writes"])
            + " parameters partly unwritten on this torch (pytorch#191763): its cells (*) time "
            "a kernel that moves fewer bytes than a correct update"
        )
    variants = list(dict.fromkeys(r.variant for r in rows))
    for dtype in dict.fromkeys(r.dtype for r in rows):
        lines += ["", f"{dtype}:", "| case | " + " | ".join(variants) + " |"]
        lines.append("|---|" + "---|" * len(variants))
        by_case: dict[str, dict[str, Row]] = {}
        for r in rows:
            if r.dtype == dtype:
                by_case.setdefault(r.case, {})[r.variant] = r
        for case, cells in by_case.items():
            out = []
            for v in variants:
                r = cells.get(v)
                if r is None:
                    out.append("-")
                    continue
                star = "*" if r.note else ""
                pct = f", {r.pct_copy:.0f}%" if r.pct_copy is not None else ""
                out.append(f"{r.x_floor:.2f}x{star} ({r.gb_per_s:.1f} GB/s{pct})")
            lines.append(f"| {case} | " + " | ".join(out) + " |")
        lines += _rounding_cost(by_case)
        if gpu:
            # Host time is per call, whatever the size: the median over this dtype's cases.
            per_variant = {
                v: statistics.median(
                    r.host_us_per_tensor for r in rows if r.variant == v and r.dtype == dtype
                )
                for v in variants
            }
            lines.append(
                "| host enqueue, us per tensor | "
                + " | ".join(f"{per_variant[v]:.1f}" for v in variants)
                + " |"
            )
    return "\n".join(lines)


def _rounding_cost(by_case: dict[str, dict[str, Row]]) -> list[str]:
    """Per backend: stochastic rounding's time over round-to-nearest's, per case."""
    lines = []
    for nearest in dict.fromkeys(v for cells in by_case.values() for v in cells):
        stochastic = f"{nearest}+sr"
        ratios = [
            f"{case} {cells[stochastic].x_floor / cells[nearest].x_floor:.2f}x"
            for case, cells in by_case.items()
            if stochastic in cells and nearest in cells
        ]
        if ratios:
            lines.append(f"{stochastic} / {nearest}: " + ", ".join(ratios))
    return lines


def write_csv(rows: Sequence[Row], path: str | Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)


def write_json(rows: Sequence[Row], meta: dict[str, Any], path: str | Path) -> None:
    with open(path, "w") as f:
        json.dump({"machine": meta, "rows": [asdict(r) for r in rows]}, f, indent=1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_device_argument(parser)
    add_list_argument(parser, "--dtype", DTYPES)
    add_sizes_argument(parser, DEFAULT_SIZES)
    parser.add_argument("--no-layer", action="store_true", help="skip the LLaMA-7B layer mix")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile chain")
    parser.add_argument(
        "--budget", type=positive_float, default=1.5, help="seconds per case (about)"
    )
    add_counts(parser, threads=2)
    parser.add_argument("--csv", type=output_path, default=None, help="write every row here")
    parser.add_argument(
        "--json", type=output_path, default=None, help="write rows and machine data here"
    )
    parser.add_argument("--plot", type=plot_path, default=None, help="write a PNG plot here")
    parser.add_argument("--no-progress", dest="progress", action="store_false")


def command(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    rows, meta = run(
        args.device,
        args.dtype,
        args.sizes,
        layer_case=not args.no_layer,
        compile_chain=not args.no_compile,
        budget_s=args.budget,
        progress=args.progress,
    )
    print(format_table(rows, meta))
    if args.csv:
        write_csv(rows, args.csv)
    if args.json:
        write_json(rows, meta, args.json)
    if args.plot:
        from .common.plots import plot_kernels

        plot_kernels(rows, meta, args.plot)
    return 0


if __name__ == "__main__":
    from bench.common.cli import main

    sys.exit(main(__spec__.name))
