"""The documentation's links hold, read from the Markdown alone (no mkdocs needed).

Every relative link and image in README.md, BENCHMARKS.md and docs/**/*.md must point at a
file that exists, and a link's anchor at a heading of its target (GitHub's anchors, which
mkdocs' strict build checks as well); every page under docs/ must be in mkdocs.yml's nav.
So a dead link or a page left out fails `make test` as it fails `make docs`.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from urllib.parse import unquote

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
DOCUMENTS = sorted([ROOT / "README.md", ROOT / "BENCHMARKS.md", *DOCS.rglob("*.md")])

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"`[^`\n]*`")
# [text](target) and ![alt](target), with an optional "title"; the text may hold one level of
# brackets (an image inside a link).
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
URL_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) for every line outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its text without markup, in lower case, every
    character but letters, digits, '_', '-' and spaces dropped, each space a hyphen."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = text.replace("*", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of `path`'s headings; a repeated heading's take -1, -2, ... as on GitHub."""
    seen: Counter[str] = Counter()
    found = set()
    for _, line in prose_lines(path.read_text()):
        match = HEADING.match(line)
        if match:
            slug = github_slug(match.group(2))
            found.add(slug if seen[slug] == 0 else f"{slug}-{seen[slug]}")
            seen[slug] += 1
    return found


def relative_links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link and image outside code that is not a URL."""
    links = []
    for number, line in prose_lines(path.read_text()):
        for match in LINK.finditer(CODE_SPAN.sub("", line)):
            target = match.group(1)
            if not URL_SCHEME.match(target):
                links.append((number, target))
    return links


def dead_links(path: Path) -> list[str]:
    """One message per link of `path` whose file or anchor does not exist."""
    dead = []
    for number, target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / unquote(file_part)).resolve() if file_part else path
        where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{number}"
        if not linked.is_file():
            dead.append(f"{where}: {target}: no such file")
        elif anchor and linked.suffix == ".md" and unquote(anchor) not in anchors(linked):
            dead.append(f"{where}: {target}: no heading with that anchor")
    return dead


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_at_an_existing_file_and_heading(document: Path) -> None:
    assert dead_links(document) == []


def test_the_checker_reports_dead_files_and_anchors_and_ignores_code(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## A section: `code=True`\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n## Local part\n\n"
        "[fine](other.md) [fine anchor](other.md#a-section-codetrue) [self](#local-part)\n"
        "[gone](missing.md) ![gone image](img/missing.png)\n"
        "[bad anchor](other.md#no-such-part) [bad self](#nowhere)\n"
        "[web](https://example.org/x.md) `[in code](missing.md)`\n"
        "```\n[in a block](missing.md)\n# not a heading\n```\n"
        "[heading in a block](#not-a-heading)\n"
    )
    assert dead_links(page) == [
        f"{page}:6: missing.md: no such file",
        f"{page}:6: img/missing.png: no such file",
        f"{page}:7: other.md#no-such-part: no heading with that anchor",
        f"{page}:7: #nowhere: no heading with that anchor",
        f"{page}:13: #not-a-heading: no heading with that anchor",
    ]


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        (
            "One backward per step: `single_backward=True`",
            "one-backward-per-step-single_backwardtrue",
        ),
        ("TRL's SFTTrainer", "trls-sfttrainer"),
        ("Sharded training (DeepSpeed ZeRO-3)", "sharded-training-deepspeed-zero-3"),
        ("A / B", "a--b"),
    ],
)
def test_anchors_are_githubs(heading: str, anchor: str) -> None:
    assert github_slug(heading) == anchor


def nav_pages(entries: list) -> list[str]:
    """The page paths of an mkdocs nav, depth first."""
    pages = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages.extend(nav_pages(value) if isinstance(value, list) else [value])
    return pages


def test_the_site_nav_lists_every_page_and_only_pages_that_exist() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    pages = nav_pages(config["nav"])
    assert [page for page in pages if not (ROOT / page).is_file()] == []
    documents = {str(path.relative_to(ROOT)) for path in DOCUMENTS}
    assert sorted(documents - set(pages)) == []
