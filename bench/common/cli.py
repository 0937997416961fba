"""The command line of every study: ``python -m bench.<study> [arguments]``.

A study module ends with

    if __name__ == "__main__":
        from bench.common.cli import main

        sys.exit(main(__spec__.name))

`main` imports the study by its name (so its functions keep their module's name, which
`process.run_isolated` needs to find them again in a fresh interpreter), builds its parser
from its `add_arguments` and runs its `command`. A bad value is refused while the arguments
are parsed, in one line, exit status 2 (`argtypes`).
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence

from .argtypes import Parser


def build_parser(module_name: str) -> argparse.ArgumentParser:
    """The parser of study `module_name` (e.g. "bench.memory")."""
    module = importlib.import_module(module_name)
    parser = Parser(
        prog=f"python -m {module_name}",
        description=module.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    module.add_arguments(parser)
    return parser


def main(module_name: str, argv: Sequence[str] | None = None) -> int:
    """Runs study `module_name` on `argv` (the process's arguments when None)."""
    args = build_parser(module_name).parse_args(argv)
    # Bad input is refused by parse_args; an error past this point is a fault, with its traceback.
    return importlib.import_module(module_name).command(args)
