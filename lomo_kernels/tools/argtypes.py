"""The parser and the argument types shared by every command line of the package.

A bad value is refused while the arguments are parsed, before any model, process or
benchmark starts: one line on stderr naming the value and what to give instead, exit
status 2 (argparse's usage-error status), no traceback. Output paths are checked the same
way, so a long run cannot fail at its end on a missing folder.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar

T = TypeVar("T")


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (no usage block); subparsers inherit the class."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _checked(text: str, convert: Callable[[str], T], ok: Callable[[T], bool], wanted: str) -> T:
    try:
        value = convert(text)
        accepted = ok(value)
    except ValueError:
        accepted = False
    if not accepted:
        raise argparse.ArgumentTypeError(f"got {text!r}: give {wanted}")
    return value


def whole_number(low: int, high: int | None = None) -> Callable[[str], int]:
    """A type for whole numbers in [low, high] (no upper bound when high is None)."""
    wanted = f"a whole number >= {low}" if high is None else f"a whole number {low} to {high}"

    def parse(text: str) -> int:
        return _checked(text, int, lambda v: v >= low and (high is None or v <= high), wanted)

    return parse


positive_int = whole_number(1)


def is_finite_positive(value: float) -> bool:
    return math.isfinite(value) and value > 0


def is_finite_non_negative(value: float) -> bool:
    return math.isfinite(value) and value >= 0


def positive_float(text: str) -> float:
    """A finite number > 0 (nan and inf are refused)."""
    return _checked(text, float, is_finite_positive, "a finite number > 0")


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (nan and inf are refused)."""
    return _checked(text, float, is_finite_non_negative, "a finite number >= 0")


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


def from_value_errors(parse: Callable[[str], T]) -> Callable[[str], T]:
    """`parse` as an argparse type: the message of the ValueError it raises is the error."""

    def wrapped(text: str) -> T:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return wrapped


def model_name(text: str) -> str:
    """A preset name or the path of a Hugging Face config.json, checked now and kept as text."""
    from .models import resolve_model

    from_value_errors(resolve_model)(text)
    return text


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


def add_model_argument(
    parser: argparse.ArgumentParser, default: str | None, note: str = ""
) -> None:
    """--model: a preset or a Hugging Face config.json (required when `default` is None)."""
    from .models import PRESETS

    parser.add_argument(
        "--model",
        type=model_name,
        required=default is None,
        default=default,
        help=f"{', '.join(PRESETS)} or a HF config.json path{note}",
    )


def add_fused_head_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--fused-head",
        action="store_true",
        help="the logits-free loss of lomo_kernels.patch_causal_lm (no [tokens x vocab] tensors)",
    )


def keyword_arguments(args: argparse.Namespace, function: Callable[..., Any]) -> dict[str, Any]:
    """The parsed values that `function` takes, by name: its parameters and the arguments'
    destinations are spelled alike, so a command passes them on without listing each."""
    taken = inspect.signature(function).parameters
    return {name: value for name, value in vars(args).items() if name in taken}
