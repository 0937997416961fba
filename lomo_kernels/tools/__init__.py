"""Command-line tools: the memory estimator, the kernel and memory benchmarks, plots.

    python -m lomo_kernels estimate --model llama-7b --optimizer lomo
    python -m lomo_kernels bench kernels [--device cuda]
    python -m lomo_kernels bench memory --model llama-168m

Modules: `models` (model shapes: presets and HF configs), `estimate` (the analytic memory
model), `bench_kernels` (update-kernel timings), `bench_memory` (measured peak memory per
optimizer), `machine` (what a figure was measured on), `plots` (PNG output), `cli` (argument
parsing and dispatch).
"""
