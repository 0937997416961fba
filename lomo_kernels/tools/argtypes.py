"""The parser and the argument types of the package's command lines (`lomo-kernels`).

A bad value is refused while the arguments are parsed, before any work starts: one line on
stderr naming the value and what to give instead, exit status 2 (argparse's usage-error
status), no traceback. The benchmarks (bench/common/argtypes.py) build on these.
"""

from __future__ import annotations

import argparse
import inspect
import math
from collections.abc import Callable
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
