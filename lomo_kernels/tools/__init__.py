"""The package's command line, what a user needs at run time:

    lomo-kernels estimate --model llama-7b --optimizer lomo   (or python -m lomo_kernels ...)
    lomo-kernels env

Modules: `cli` (argument parsing and dispatch), `argtypes` (argument checks), `estimate` (the
analytic memory model), `models` (model shapes: presets and HF configs), `env` (the
environment report: versions, CPU level, bf16 support, which backends load).
The benchmarks, the GPU check and the demo live in the repository's bench/, outside the
package.
"""
