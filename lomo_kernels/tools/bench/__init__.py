"""The benchmarks of `lomo-kernels bench NAME`: one module per benchmark, and what they share.

Each benchmark module adds its arguments (`add_arguments`) and runs them (`command`); the CLI
(`tools/cli.py`) finds them through `BENCHMARKS`. Shared: `timing` (variants timed
interleaved, the clocks), `meter` (peak memory readings), `process` (a measurement in a
fresh interpreter, or on several ranks), `train_runner` (one measured training run, for
`bench train`, `bench quality` and the demo), `sharded` (the 2-rank runs of `bench zero3`
and `bench fsdp2`), `progress` (the progress bar).
"""

# CLI name -> (module in this package, one-line help)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "kernels": ("kernels", "time the fused update against its baselines, sizes 4K to 64M"),
    "update": (
        "update",
        "the C++ CPU update, every option set, against torch's updates and the memory floor",
    ),
    "cpu-levels": (
        "cpu_levels",
        "the C++ CPU update and sum of squares at every vector level this CPU runs",
    ),
    "host-time": (
        "host_time",
        "host time of one update call on a small tensor, the ways a program makes it",
    ),
    "memory": (
        "memory",
        "measure peak memory per optimizer (parameters, gradients, states, activations)",
    ),
    "train": (
        "train",
        "end-to-end fine-tuning per optimizer: tokens/s, step time, peak memory, OOM",
    ),
    "single-backward": (
        "single_backward",
        "step time of single_backward=True against the exact two-pass mode",
    ),
    "compile": ("compile", "a Lomo step's time: eager, compiled forward, compiled autograd"),
    "head": (
        "head",
        "an LM head's loss, backward and update: fused, unfused, liger-kernel, cut-cross-entropy",
    ),
    "head-sweeps": (
        "head_sweeps",
        "the fused head's backward: what one more sweep over the vocabulary costs",
    ),
    "quality": (
        "quality",
        "fine-tuning quality of bf16/fp16 weights: the share of the fp32-weights gain kept",
    ),
    "zero3": (
        "zero3",
        "ZeRO-3 on 2 ranks: per-rank peak memory and step time, ours against DeepSpeed's",
    ),
    "fsdp2": ("fsdp2", "FSDP2 on 2 ranks: per-rank peak memory and step time per optimizer"),
}
