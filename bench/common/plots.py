"""PNG plots of the benchmark results (matplotlib, imported only here)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

NEEDS_MATPLOTLIB = "plots need matplotlib: pip install matplotlib (or pip install -e '.[bench]')"


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ValueError(NEEDS_MATPLOTLIB) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _title(meta: dict[str, Any]) -> str:
    from .machine import one_line

    kind = "GPU timing" if meta.get("gpu") else "CPU timing (not a GPU figure)"
    return f"{kind}: {one_line(meta)}"


def plot_kernels(rows: Sequence[Any], meta: dict[str, Any], path: str | Path) -> None:
    """Achieved GB/s against size, one panel per dtype, one line per variant."""
    plt = _pyplot()
    dtypes = list(dict.fromkeys(r.dtype for r in rows))
    variants = list(dict.fromkeys(r.variant for r in rows))
    fig, axes = plt.subplots(1, len(dtypes), figsize=(5 * len(dtypes), 4.2), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes, strict=True):
        for variant in variants:
            pts = sorted(
                (r.numel, r.gb_per_s)
                for r in rows
                if r.dtype == dtype and r.variant == variant and r.case[0].isdigit()
            )
            if pts:
                style = "--" if variant == "axpy_floor" else "-"
                ax.plot(*zip(*pts, strict=True), style, marker="o", ms=3, label=variant)
        if meta.get("copy_gb_per_s"):
            ax.axhline(meta["copy_gb_per_s"], color="grey", lw=0.8, label="d2d copy")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("elements per tensor")
        ax.set_ylabel("GB/s (param read + grad read + param write)")
        ax.set_title(dtype)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(_title(meta), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


PARTS = ("parameters", "gradients", "optimizer_states", "activations")
COLOURS = ("#4c72b0", "#dd8452", "#c44e52", "#55a868")


def plot_memory(results: Sequence[dict[str, Any]], meta: dict[str, Any], path: str | Path) -> None:
    """Stacked bars per optimizer: parameters, gradients, optimizer states, activations (MiB)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(1.4 * len(results) + 2, 4.5))
    labels = [r["label"] for r in results]
    bottom = [0.0] * len(results)
    for part, colour in zip(PARTS, COLOURS, strict=True):
        values = [r["parts_mib"][part] for r in results]
        ax.bar(labels, values, bottom=bottom, color=colour, label=part.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for x, r in enumerate(results):
        ax.text(x, bottom[x], f"{r['peak_mib']:.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("peak memory (MiB)")
    ax.legend(fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    kind = "GPU" if meta.get("gpu") else "CPU"
    ax.set_title(f"{meta.get('model', '')}: {kind} peak memory of a training step", fontsize=9)
    fig.suptitle(_title(meta), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_train(results: Sequence[dict[str, Any]], meta: dict[str, Any], path: str | Path) -> None:
    """Bars per optimizer: tokens/s and peak memory above the model; OOM and unavailable
    ones are labelled where their bar would be."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.5 * len(results) + 3), 4.2))
    names = [r["optimizer"] for r in results]
    panels = (
        ("tokens_per_s", "tokens/s (higher is better)", "#4c72b0"),
        ("peak_above_model_mib", "peak above the model, MiB (lower is better)", "#c44e52"),
    )
    for ax, (key, label, colour) in zip(axes, panels, strict=True):
        values = [r.get(key, 0.0) if r["status"] == "ok" else 0.0 for r in results]
        ax.bar(names, values, color=colour)
        for x, r in enumerate(results):
            text = f"{values[x]:,.0f}" if r["status"] == "ok" else r["status"]
            ax.text(x, values[x], text, ha="center", va="bottom", fontsize=7)
        ax.set_ylabel(label)
        ax.tick_params(axis="x", labelsize=7, labelrotation=30)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(
        f"{meta['model']}, {meta['dtype']}, batch {meta['batch']} x {meta['seq']}\n" + _title(meta),
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
