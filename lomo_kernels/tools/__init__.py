"""Command-line tools: the memory estimator, the benchmarks, the GPU check, the demo, plots.

    python -m lomo_kernels estimate --model llama-7b --optimizer lomo
    python -m lomo_kernels bench kernels [--device cuda]
    python -m lomo_kernels bench memory --model llama-168m
    python -m lomo_kernels bench train --model tiny [--device cuda]
    python -m lomo_kernels bench NAME --help
    python -m lomo_kernels gpu-check --device cuda --results DIR
    python -m lomo_kernels.tools.demo

Modules: `cli` (argument parsing and dispatch), `argtypes` (argument checks), `estimate` (the
analytic memory model), `models` (model shapes: presets and HF configs, and random-weight
models of a shape), `char_model` (the character-level model and corpus of the demo and
`bench quality`), `optimizers` (the optimizers compared, each as one training step),
`machine` (what a figure was measured on), `dtypes` (the dtype names), `plots` (PNG output),
`bench`, one module per benchmark and what they share (lomo_kernels/tools/bench/),
`gpu_check` (every GPU question in one timed run: `make gpu-check`) and `demo` (`make demo`).
"""
