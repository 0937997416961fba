"""The studies' command lines as the tests run them, in this process: `main(["memory",
"--model", "tiny"])` is ``python -m bench.memory --model tiny`` (bench/common/cli.py)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from bench.common import cli


def main(argv: Sequence[str]) -> int:
    study, *rest = argv
    return cli.main(f"bench.{study}", rest)


def build_parser(study: str) -> argparse.ArgumentParser:
    return cli.build_parser(f"bench.{study}")
