"""`lomo-kernels` / `python -m lomo_kernels`: argument parsing and dispatch.

    lomo-kernels estimate --model llama-7b --optimizer lomo [--gpus N --gpu-mem GB --zero3]
    lomo-kernels env [--json]

Each subcommand's module adds its own arguments (`add_arguments`) and runs them (`command`).
Arguments are checked while they are parsed (`argtypes`), before any work starts. The
benchmarks, the GPU check and the demo are not part of the package: they run from a clone
(`python -m bench.<study>`, bench/README.md).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from .argtypes import Parser

# subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "estimate": ("lomo_kernels.tools.estimate", "analytic peak memory per GPU: does it fit?"),
    "env": (
        "lomo_kernels.tools.env",
        "versions, CPU level, bf16 support and which backends load here",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="lomo-kernels", description="LOMO / AdaLomo kernels: estimate, env")
    top = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        sub = top.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(_module=module_name)
        importlib.import_module(module_name).add_arguments(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Bad input is refused by parse_args; an error past this point is a fault, with its traceback.
    return importlib.import_module(args._module).command(args)


if __name__ == "__main__":
    sys.exit(main())
