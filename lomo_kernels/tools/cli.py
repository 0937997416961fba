"""`lomo-kernels` / `python -m lomo_kernels`: argument parsing and dispatch.

    lomo-kernels estimate --model llama-7b --optimizer lomo [--gpus N --gpu-mem GB --zero3]
    lomo-kernels bench kernels [--device cpu|cuda] [--csv F] [--json F] [--plot F.png]
    lomo-kernels bench memory --model llama-168m [--device cpu|cuda] [--plot F.png]
    lomo-kernels bench head [--shape small|llama-3-8b] [--device cpu|cuda] [--variants ...]
    lomo-kernels bench train --model tiny [--device cpu|cuda] [--optimizers adamw,lomo,...]
    lomo-kernels bench quality [--steps N] [--rows all|paper] [--json F] [--plot F.png]
    lomo-kernels bench NAME --help      (every benchmark: lomo_kernels/tools/bench/__init__.py)
    lomo-kernels demo [--steps N] [--optimizers lomo,adamw]
    lomo-kernels gpu-check [--device cuda|cpu] [--results DIR] [--budget-s 540]

Each subcommand's module adds its own arguments (`add_arguments`) and runs them (`command`);
heavy imports (transformers, matplotlib) happen only in the subcommand that needs them.
Arguments are checked while they are parsed (`argtypes`), before any work starts.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from .argtypes import Parser
from .bench import BENCHMARKS

# subcommand path -> (module, one-line help)
COMMANDS: dict[tuple[str, ...], tuple[str, str]] = {
    ("estimate",): ("lomo_kernels.tools.estimate", "analytic peak memory per GPU: does it fit?"),
    ("demo",): (
        "lomo_kernels.tools.demo",
        "fine-tune a small LLaMA with Lomo, AdaLomo and AdamW side by side",
    ),
    ("gpu-check",): (
        "lomo_kernels.tools.gpu_check",
        "the GPU paths in one command: smoke tests, then train, head, host-time and quality "
        "benchmarks, each part under a time budget",
    ),
} | {
    ("bench", name): (f"lomo_kernels.tools.bench.{module}", help_text)
    for name, (module, help_text) in BENCHMARKS.items()
}


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="lomo-kernels", description="LOMO / AdaLomo kernels: estimate, benchmark, demo"
    )
    top = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    groups: dict[str, argparse._SubParsersAction] = {}
    for path, (module_name, help_text) in COMMANDS.items():
        if len(path) == 1:
            sub = top.add_parser(path[0], help=help_text, description=help_text)
        else:
            if path[0] not in groups:
                group_help = "benchmarks: " + ", ".join(BENCHMARKS)
                group = top.add_parser(path[0], help=group_help, description=group_help)
                groups[path[0]] = group.add_subparsers(
                    dest="subcommand", required=True, metavar="WHAT"
                )
            sub = groups[path[0]].add_parser(path[1], help=help_text, description=help_text)
        sub.set_defaults(_module=module_name)
        _module(module_name).add_arguments(sub)
    return parser


def _module(name: str):  # noqa: ANN202 - a module object
    return importlib.import_module(name)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # Bad input is refused by parse_args; an error past this point is a fault, with its traceback.
    return _module(args._module).command(args)


if __name__ == "__main__":
    sys.exit(main())
