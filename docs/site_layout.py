"""mkdocs hook: the site's files sit at their paths in the repository.

The pages under docs/ link to README.md, BENCHMARKS.md, MEASURING.md and the plots in
bench/results/ by their repository paths (`../README.md`), so that one link works on a code
host and in the site. mkdocs resolves links inside its docs folder only, so this hook places
every page at its repository path (`docs/usage.md`) and adds the repository's own files
beside them: mkdocs then checks every link and anchor, in strict mode, against the tree as
it is, and README.md becomes the site's home page.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files, InclusionLevel

# Repository files the site shows besides docs/: glob patterns from the repository root.
REPOSITORY_FILES = ("README.md", "BENCHMARKS.md", "MEASURING.md", "bench/results/*.png")


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """The docs folder's files moved under `docs/`, the theme's kept, the repository's added."""
    root = Path(config.config_file_path).resolve().parent
    docs = Path(config.docs_dir).resolve()
    docs_prefix = docs.relative_to(root).as_posix()

    def at(path: str, inclusion: InclusionLevel = InclusionLevel.UNDEFINED) -> File:
        """The file at `path` from the repository root, at that path in the site."""
        return File(
            path, str(root), config.site_dir, config.use_directory_urls, inclusion=inclusion
        )

    placed = Files([])
    for file in files:
        source = Path(file.abs_src_path).resolve() if file.abs_src_path else None
        if source is not None and source.is_relative_to(docs):
            placed.append(at(f"{docs_prefix}/{file.src_uri}", file.inclusion))
        else:
            placed.append(file)
    for pattern in REPOSITORY_FILES:
        for path in sorted(root.glob(pattern)):
            placed.append(at(path.relative_to(root).as_posix()))
    return placed
