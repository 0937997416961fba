"""`python -m bench.update`: the fused LOMO update (C++ CPU backend) against its baselines.

    python -m bench.update [--numel 32M] [--reps R] [--mix-reps R] [--mix-layers L]
                              [--threads T] [--json F]

Method (MEASURING.md): 2 threads, one process, variants timed interleaved
(A, B, C, A, B, C, ...), medians and ratios of medians from the same run. Sizes: one
32M-element tensor (beyond the caches: memory-bound) and the tensor mix of a small LLaMA
model (per-call overhead). Every variant updates the same tensors in place.

Variants:
  fused      C++ lomo_update_ with every option on and non-neutral: unscale by a device-tensor
             loss scale, clip by value, a clip_coef tensor, weight decay and found_inf (the
             full LOMO option set, one pass)
  fused_plain  C++ lomo_update_ with lr only: the same work as fused_sgd
  fused_sr   the full set with stochastic rounding (bf16 params)
  axpy       p.add_(g, alpha=-lr): the memory floor (same bytes moved), and exactly the
             update torch.optim.SGD's own (non-fused) step applies
  official   lomo-optim's per-parameter chain: to fp32, div, clamp, mul, p to fp32, mul,
             add, copy back
  fused_sgd  torch._fused_sgd_ (plain SGD, no unscale/clip/check)
  fused_sgd_amp  torch._fused_sgd_ with weight_decay, grad_scale and found_inf
  reference  the pure-PyTorch reference backend, full option set

torch 2.13's CPU _fused_sgd_ leaves every whole SIMD block of a bf16/fp16 parameter
unwritten (pytorch issue 191763, fixed in later releases): it then moves a third fewer
bytes than any correct update. The benchmark probes this and labels the rows it affects.

The official chain runs on neutral values (loss scale 1, clip_coef 1) so that its in-place
grad ops do not drift the data between repetitions; torch's ops do the same work whatever
the values. Our kernels compile neutral options out, so they get non-neutral ones.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import torch

from lomo_kernels.ops.lomo import cpp_backend as cpp_backend
from lomo_kernels.ops.lomo import reference as reference

from . import kernels
from .common import machine
from .common.argtypes import add_counts, add_json_argument, from_value_errors
from .common.dtypes import DTYPES as ALL_DTYPES
from .common.models import PRESETS
from .common.timing import read_once, time_interleaved
from .kernels import (
    CLIP_VALUE,
    LR,
    WEIGHT_DECAY,
    fused_sgd_writes_params,
    official_chain,
    parse_size,
    size_label,
)

NUMEL = 32 * 2**20
MIX_LAYERS = 8
DTYPES = {label: ALL_DTYPES[label] for label in ("bf16", "fp32")}
TARGETS = (
    "targets: fused/axpy <= 1.15 (bf16, fp32); official/fused >= 10 (bf16); fused/fused_sgd <= 1.0"
)


def llama_layer_shapes(layers: int = MIX_LAYERS) -> list[int]:
    """numel of each parameter of a small LLaMA stack: llama-20m's layer (hidden 256,
    intermediate 688), `layers` times."""
    return PRESETS["llama-20m"].layer_tensor_numels() * layers


class Case(kernels.Case):
    """The kernel benchmark's case (same tensors, same option values) with the C++
    backend's variants: every option set, stochastic rounding, torch's AMP SGD, the
    reference, and the gradient-norm pass."""

    def __init__(self, dtype: torch.dtype, sizes: list[int]) -> None:
        super().__init__("cpu", sizes, dtype, "cpu")
        self.grad_scale = torch.ones(1)
        self.dtype = dtype

    def _fused(self, module, stochastic_rounding: bool) -> None:
        for p, g in zip(self.params, self.grads, strict=True):
            module.lomo_update_(
                p,
                g,
                self.lr,
                self.inv_scale,
                CLIP_VALUE,
                self.clip_coef,
                WEIGHT_DECAY,
                self.found_inf,
                None,
                stochastic_rounding,
                1234,
                None,
                0,
            )

    def fused(self) -> None:
        self._fused(cpp_backend, stochastic_rounding=False)

    def fused_plain(self) -> None:
        for p, g in zip(self.params, self.grads, strict=True):
            cpp_backend.lomo_update_(
                p, g, self.lr, None, None, None, 0.0, None, None, False, 1234, None, 0
            )

    def fused_sr(self) -> None:
        self._fused(cpp_backend, stochastic_rounding=True)

    def reference(self) -> None:
        self._fused(reference, stochastic_rounding=False)

    def official(self) -> None:
        official_chain(self.params, self.grads)

    def fused_sgd(self) -> None:
        # Per parameter, as a post-accumulate-grad hook would call it.
        kernels.fused_sgd(self.params, self.grads, LR)

    def fused_sgd_amp(self) -> None:
        # torch's sync-free AMP SGD: weight decay, unscale by grad_scale, skip on found_inf.
        kernels.fused_sgd(
            self.params,
            self.grads,
            LR,
            weight_decay=WEIGHT_DECAY,
            grad_scale=self.grad_scale,
            found_inf=self.found_inf,
        )

    def settle(self, _variant: str = "") -> None:
        """Reads every parameter and gradient once: the same cache state before each call."""
        read_once(self.tensors)

    def variants(self) -> dict[str, Callable[[], None]]:
        out = {
            "fused": self.fused,
            "fused_plain": self.fused_plain,
            "axpy": self.axpy,
            "official": self.official,
            "fused_sgd": self.fused_sgd,
            "fused_sgd_amp": self.fused_sgd_amp,
            "reference": self.reference,
        }
        if self.dtype == torch.bfloat16:
            out["fused_sr"] = self.fused_sr
        return out

    def sumsq_variants(self) -> dict[str, Callable[[], None]]:
        """The gradient-norm pass: C++ grad_sumsq_ against torch's own reductions."""
        sumsq = torch.zeros(1)

        def cpp() -> None:
            for g in self.grads:
                cpp_backend.grad_sumsq_(g, None, sumsq, self.found_inf)

        def vector_norm() -> None:
            for g in self.grads:
                torch.linalg.vector_norm(g, dtype=torch.float32)

        def ref() -> None:
            for g in self.grads:
                reference.grad_sumsq_(g, None, sumsq, self.found_inf)

        return {"grad_sumsq": cpp, "vector_norm": vector_norm, "reference": ref}


# Variants that allocate fp32 temporaries of every tensor. Timed in the same loop as the
# light kernels they leave the one timed next measurably slower (the caches are not the
# only cost: the settle pass does not undo it), so they get their own loop with `fused`.
HEAVY = ("official", "reference")


def _split_heavy(
    variants: dict[str, Callable[[], None]],
) -> tuple[dict[str, Callable[[], None]], dict[str, Callable[[], None]]]:
    light = {name: fn for name, fn in variants.items() if name not in HEAVY}
    heavy = {"fused": variants["fused"]} | {name: variants[name] for name in HEAVY}
    return light, heavy


def run(
    numel: int, reps: int, mix_reps: int, mix_layers: int = MIX_LAYERS
) -> dict[str, dict[str, dict[str, float]]]:
    """{case: {dtype: {variant: median seconds}}}."""
    cases = ("single", "single_heavy", "mix", "mix_heavy", "sumsq")
    results: dict[str, dict[str, dict[str, float]]] = {case: {} for case in cases}
    for label, dtype in DTYPES.items():
        case = Case(dtype, [numel])
        light, heavy = _split_heavy(case.variants())
        results["single"][label] = time_interleaved(light, reps, settle=case.settle)
        results["single_heavy"][label] = time_interleaved(
            heavy, max(3, reps // 4), settle=case.settle
        )
        results["sumsq"][label] = time_interleaved(case.sumsq_variants(), reps, settle=case.settle)
        del case
        mix = Case(dtype, llama_layer_shapes(mix_layers))
        light, heavy = _split_heavy(mix.variants())
        results["mix"][label] = time_interleaved(light, mix_reps, settle=mix.settle)
        results["mix_heavy"][label] = time_interleaved(heavy, mix_reps, settle=mix.settle)
    return results


def _row(name: str, cells: list[str]) -> str:
    return f"| {name:<14} | " + " | ".join(f"{c:>18}" for c in cells) + " |"


def report(
    results: dict[str, dict[str, dict[str, float]]], numel: int, mix_layers: int = MIX_LAYERS
) -> str:
    dtypes = {label: DTYPES[label] for label in results["single"]}
    broken = [label for label, dtype in dtypes.items() if not fused_sgd_writes_params(dtype)]
    lines = [
        "CPU timings: medians of interleaved repetitions in one process; "
        "x = time / time(first row) of the same column.",
    ]
    if broken:
        lines.append(
            f"torch._fused_sgd_ leaves {', '.join(broken)} parameters unwritten on this torch "
            "(pytorch#191763): those fused_sgd* cells time a kernel that moves a third fewer "
            "bytes than a correct update (marked *)."
        )
    mix = llama_layer_shapes(mix_layers)
    size = size_label(numel)
    single_title = f"one tensor of {size} elements"
    mix_title = (
        f"small-LLaMA mix: {len(mix)} tensors, {sum(mix) / 1e6:.1f}M elements, one call per tensor"
    )
    heavy_note = ": official chain and reference, in their own loop with fused"
    titles = {
        "single": single_title,
        "single_heavy": single_title + heavy_note,
        "mix": mix_title,
        "mix_heavy": mix_title + heavy_note,
        "sumsq": f"gradient sum of squares, one tensor of {size} elements",
    }
    for case, per_dtype in results.items():
        lines += ["", titles[case], _row("variant", [f"{d} ms (x)" for d in per_dtype])]
        lines.append("|" + "-" * 16 + ("|" + "-" * 20) * len(per_dtype) + "|")
        names = list(dict.fromkeys(n for d in per_dtype.values() for n in d))
        for name in names:
            cells = []
            for label, timings in per_dtype.items():
                if name not in timings:
                    cells.append("-")
                    continue
                t, base = timings[name], next(iter(timings.values()))
                mark = "*" if name.startswith("fused_sgd") and label in broken else " "
                cells.append(f"{t * 1e3:8.2f} ({t / base:6.2f}x){mark}")
            lines.append(_row(name, cells))
    lines += ["", TARGETS]
    single = results["single"]

    def ratio(label: str, a: str, b: str) -> float:
        return single[label][a] / single[label][b]

    checks = [
        ("bf16 fused/axpy", ratio("bf16", "fused", "axpy"), "<=", 1.15),
        ("fp32 fused/axpy", ratio("fp32", "fused", "axpy"), "<=", 1.15),
        (
            "bf16 official/fused",
            results["single_heavy"]["bf16"]["official"] / results["single_heavy"]["bf16"]["fused"],
            ">=",
            10,
        ),
    ]
    for label in single:
        checks.append((f"{label} fused/fused_sgd", ratio(label, "fused", "fused_sgd"), "<=", 1))
    for label in single:  # torch's sync-free AMP SGD: unscale, found_inf skip, weight decay
        checks.append(
            (f"{label} fused/fused_sgd_amp", ratio(label, "fused", "fused_sgd_amp"), "<=", 1)
        )
    for label, value, op, target in checks:
        ok = value <= target if op == "<=" else value >= target
        skipped = "fused_sgd" in label and label[:4] in broken
        note = " (* torch skips the write-back)" if skipped else ""
        lines.append(
            f"  {label:<22} {value:6.3f} ({op} {target}): {'met' if ok else 'NOT met'}{note}"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--numel",
        type=from_value_errors(parse_size),
        default=size_label(NUMEL),
        help="elements of the one-tensor case (4K, 32M, ...; default 32M)",
    )
    add_counts(parser, reps=21, mix_reps=21, mix_layers=MIX_LAYERS, threads=2)
    add_json_argument(parser)


def command(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    if not cpp_backend.is_available("cpu"):
        raise SystemExit(f"C++ backend unavailable: {cpp_backend.unavailable_reason('cpu')}")
    results = run(args.numel, args.reps, args.mix_reps, args.mix_layers)
    meta: dict[str, Any] = machine.describe("cpu") | {
        "numel": args.numel,
        "mix_layers": args.mix_layers,
    }
    table = report(results, args.numel, args.mix_layers)
    machine.print_results(meta, table, args.json, seconds=results)
    return 0


if __name__ == "__main__":
    from bench.common.cli import main

    sys.exit(main(__spec__.name))
