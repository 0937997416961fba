"""Every benchmark of the project, run from a clone, outside the package:

    python -m bench                      the studies, one line each
    python -m bench.<study> [--help]     one study, e.g. python -m bench.memory --model llama-168m
    python -m bench.gpu_check            every GPU question in one timed run (make gpu-check)
    python -m bench.demo                 the demo (make demo)
    pytest bench/ --benchmark-only       the kernel cases as a pytest-benchmark suite

One module per study (each adds its arguments, `add_arguments`, and runs them, `command`;
`common/cli.py` gives each its command line). Shared, once, in `common/`: `argtypes` (the
argument checks), `timing` (variants timed interleaved, the clocks), `meter` (peak memory
readings), `process` (a measurement in a fresh interpreter, or on several ranks),
`train_runner` (one measured training run, for `train`, `quality` and the demo), `sharded`
(the 2-rank runs of `zero3` and `fsdp2`), `progress` (the progress bar), `models` (random
weights of a shape), `char_model` (the character model and corpus, data/corpus.txt, of the
demo and `quality`), `optimizers` (the optimizers compared, each as one training step),
`machine` (what a figure was measured on), `dtypes`, `plots`, `torch_internals` (private
torch names only the benchmarks read).
"""

# study (its module: python -m bench.<study>) -> one-line help
STUDIES: dict[str, str] = {
    "kernels": "time the fused update against its baselines, sizes 4K to 64M",
    "update": "the C++ CPU update, every option set, against torch's updates and the memory floor",
    "cpu_levels": "the C++ CPU update and sum of squares at every vector level this CPU runs",
    "accumulate": "gradient accumulation's pass per backend: to nearest and stochastic, vs add_",
    "host_time": "host time of one update call on a small tensor, the ways a program makes it",
    "memory": "measure peak memory per optimizer (parameters, gradients, states, activations)",
    "train": "end-to-end fine-tuning per optimizer: tokens/s, step time, peak memory, OOM",
    "single_backward": "step time of single_backward=True against the exact two-pass mode",
    "compile": "a Lomo step's time: eager, compiled forward, compiled autograd",
    "head": "an LM head's loss, backward, update: fused, unfused, liger-kernel, cut-cross-entropy",
    "head_sweeps": "the fused head's backward: what one more sweep over the vocabulary costs",
    "preference_rl": "peak memory of a TRL DPO and GRPO step: fused head + Lomo, TRL's head",
    "quality": "fine-tuning quality of bf16/fp16 weights: the share of the fp32-weights gain kept",
    "adalomo_slices": "one rank's AdaLomo step on its slice of a sharded matrix, per backend",
    "zero3": "ZeRO-3 on 2 ranks: per-rank peak memory and step time, ours against DeepSpeed's",
    "fsdp2": "FSDP2 on 2 ranks: per-rank peak memory and step time per optimizer",
}
