"""The progress bar of a benchmark's runs (tqdm on stderr, where it is installed)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def with_progress(
    items: Iterable[T], enabled: bool, desc: str, unit: str, name: Callable[[T], str] = str
) -> Iterator[T]:
    """`items` one by one; when `enabled`, a bar that names the item under way."""
    try:
        from tqdm import tqdm
    except ImportError:
        enabled = False
    if not enabled:
        yield from items
        return
    bar = tqdm(items, desc=desc, unit=unit)
    for item in bar:
        bar.set_postfix_str(name(item))
        yield item
