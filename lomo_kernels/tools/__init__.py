"""Command-line tools: the memory estimator, every benchmark the CLI runs, plots.

    python -m lomo_kernels estimate --model llama-7b --optimizer lomo
    python -m lomo_kernels bench kernels [--device cuda]
    python -m lomo_kernels bench memory --model llama-168m
    python -m lomo_kernels bench train --model tiny [--device cuda]

Modules: `models` (model shapes: presets and HF configs), `estimate` (the analytic memory
model), `bench_kernels` (update-kernel timings and their cases), `bench_memory` (measured
peak memory per optimizer, split by part; the VmHWM and allocator readings), `bench_train`
(end-to-end fine-tuning per optimizer), `optimizers` (the optimizers compared, each as one
training step), `train_runner` (one measured training run in a process of its own, for
`bench train` and the demo), `machine` (what a figure was measured on), `plots` (PNG
output), `argtypes` (argument checks), `cli` (argument parsing and dispatch).
"""
