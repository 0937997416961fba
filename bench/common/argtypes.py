"""The benchmarks' argument types, on top of the package's (lomo_kernels/tools/argtypes.py).

Output paths are checked while the arguments are parsed, so a long run cannot fail at its
end on a missing folder; a device is refused when this machine has none. Every type a
benchmark takes is importable from here, the package's included.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from lomo_kernels.tools.argtypes import (
    Parser,
    add_fused_head_argument,
    add_model_argument,
    from_value_errors,
    is_finite_non_negative,
    is_finite_positive,
    keyword_arguments,
    model_name,
    non_negative_float,
    positive_float,
    positive_int,
    whole_number,
)

__all__ = [
    "Parser",
    "add_counts",
    "add_device_argument",
    "add_fused_head_argument",
    "add_json_argument",
    "add_list_argument",
    "add_model_argument",
    "add_output_arguments",
    "comma_list",
    "device",
    "from_value_errors",
    "is_finite_non_negative",
    "is_finite_positive",
    "keyword_arguments",
    "model_name",
    "non_negative_float",
    "output_path",
    "plot_path",
    "positive_float",
    "positive_int",
    "whole_number",
]


def comma_list(
    choices: Sequence[str], aliases: Mapping[str, str] | None = None
) -> Callable[[str], list[str]]:
    """A type for a comma list of `choices` (case-insensitive; `aliases` map other names)."""
    aliases = aliases or {}

    def parse(text: str) -> list[str]:
        names = [aliases.get(n, n) for n in (t.strip().lower() for t in text.split(",")) if n]
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            what = f"unknown {', '.join(map(repr, unknown))}" if unknown else "empty list"
            raise argparse.ArgumentTypeError(f"{what}: give a comma list of {', '.join(choices)}")
        return names

    return parse


def device(text: str) -> str:
    """'cpu', 'cuda' or 'cuda:N', refused when this machine has no such CUDA device."""
    name = text.strip().lower()
    kind, _, index = name.partition(":")
    if name == "cpu":
        return name
    if kind != "cuda" or (index and not index.isdigit()):
        raise argparse.ArgumentTypeError(f"unknown device {text!r}: give cpu, cuda or cuda:N")
    import torch

    if not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: no CUDA device here; run with --device cpu")
    count = torch.cuda.device_count()
    if index and int(index) >= count:
        raise argparse.ArgumentTypeError(
            f"{text!r}: this machine has {count} CUDA device(s); give cuda:0 to cuda:{count - 1}"
        )
    return name


def output_path(text: str) -> str:
    """A file to write at the end of a run: its folder must exist and be writable now."""
    path = Path(text).expanduser()
    folder = path.parent
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder: give a file name inside it")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(
            f"folder {str(folder)!r} of {text!r} does not exist: create it or pick another path"
        )
    if not os.access(folder, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(
            f"folder {str(folder)!r} of {text!r} is not writable: pick another path"
        )
    return str(path)


def plot_path(text: str) -> str:
    """An output path for a PNG, refused up front when matplotlib is not installed."""
    from .plots import NEEDS_MATPLOTLIB

    path = output_path(text)
    if importlib.util.find_spec("matplotlib") is None:
        raise argparse.ArgumentTypeError(NEEDS_MATPLOTLIB)
    return path


def add_json_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=output_path, default=None, help="write the results here")


def add_output_arguments(parser: argparse.ArgumentParser, plot_help: str) -> None:
    """The benchmarks' common outputs: --json (results), --plot (a PNG), --no-progress."""
    add_json_argument(parser)
    parser.add_argument("--plot", type=plot_path, default=None, help=plot_help)
    parser.add_argument("--no-progress", dest="progress", action="store_false")


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", type=device, default="cpu", help="cpu or cuda (default cpu)")


def add_counts(parser: argparse.ArgumentParser, **defaults: int) -> None:
    """Whole-number options >= 1 by name and default: `add_counts(parser, batch=2)` adds
    --batch (default 2)."""
    for name, default in defaults.items():
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=positive_int, default=default, help=f"default {default}")


def add_list_argument(
    parser: argparse.ArgumentParser,
    flag: str,
    choices: Sequence[str],
    default: str | None = None,
    **options: Any,
) -> None:
    """A comma list of `choices` (default: `default`, else all of them); `options`: more of
    add_argument's keywords (dest, aliases of comma_list)."""
    aliases = options.pop("aliases", None)
    parser.add_argument(
        flag,
        type=comma_list(tuple(choices), aliases),
        default=default or ",".join(choices),
        help=f"comma list of {', '.join(choices)} (default {default or 'all'})",
        **options,
    )
