"""A clone holds every document the code cites.

Code, tests and docs cite the contracts as ``design.md §2.7`` (or a range, ``§2.3-2.4``). Each such reference
must name a numbered heading of docs/design.md, and no tracked file may send a reader outside the repository
(``../shared/``), where a clone or an installed wheel has nothing.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DESIGN = REPO / "docs" / "design.md"

#: Where references are looked for; tests/fixtures holds frozen third-party plugins, left as they were written.
SEARCHED = ("src/", "plugins/", "tests/", "docs/", "README.md", "benchmarks/", "scripts/", "examples/")
NOT_SEARCHED = ("tests/fixtures/",)

#: ``design.md §2.3``, ``design.md §2.3-2.4`` (an en dash too), with the reference possibly broken over a line.
REFERENCE = re.compile(r"design\.md\s*§\s*(\d+(?:\.\d+)*)(?:\s*[-–]\s*(\d+(?:\.\d+)*))?")
#: ``## 2. Contracts every backend keeps``, ``### 2.7 Weight refit``.
HEADING = re.compile(r"^#{2,4}\s+(\d+(?:\.\d+)*)\.?\s+\S", re.M)
#: A path that leaves the repository for the project's old notes folder beside it.
OUTSIDE = re.compile(r"\.\./shared\b|(?<![\w.])shared/(?:design\.md|seeds)")


def tracked_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    paths = [REPO / name for name in out.split("\0") if name]
    paths += [DESIGN] if DESIGN not in paths else []  # checked before its first commit too
    return [p for p in paths if p.is_file()]


def text_of(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None  # binary


def sections() -> set[str]:
    return set(HEADING.findall(DESIGN.read_text(encoding="utf-8")))


def references() -> list[tuple[str, int, str]]:
    """``(file, line, section)`` for every section a searched file cites."""
    found = []
    for path in tracked_files():
        rel = path.relative_to(REPO).as_posix()
        if not rel.startswith(SEARCHED) or rel.startswith(NOT_SEARCHED) or path == DESIGN:
            continue
        text = text_of(path)
        if text is None or "design.md" not in text:
            continue
        for match in REFERENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found += [(rel, line, section) for section in match.groups() if section]
    return found


def test_design_has_the_numbered_sections_the_code_cites():
    have = sections()
    assert {"1", "2", "3", "4", "5"} <= have
    assert {f"2.{i}" for i in range(1, 10)} <= have


def test_every_design_reference_names_a_section_that_exists():
    refs = references()
    assert len(refs) >= 50, f"only {len(refs)} references found: is the pattern still right?"
    have = sections()
    missing = [f"{rel}:{line}: design.md §{section}" for rel, line, section in refs if section not in have]
    assert not missing, "references to no heading of docs/design.md:\n" + "\n".join(missing)


def test_a_bare_design_md_mention_says_where_it_is():
    """``design.md`` without a section is only ever this page's own path (or a link to it)."""
    loose = []
    for path in tracked_files():
        rel = path.relative_to(REPO).as_posix()
        if not rel.startswith(SEARCHED) or rel.startswith(NOT_SEARCHED) or path == DESIGN:
            continue
        text = text_of(path) or ""
        for match in re.finditer(r"design\.md", text):
            after = text[match.end() : match.end() + 4]
            before = text[max(0, match.start() - 5) : match.start()]
            if (
                re.match(r"\s*§", after)
                or before.endswith(("/", "(", "["))
                or rel == "tests/project/test_design_refs.py"
            ):
                continue
            loose.append(f"{rel}:{text.count(chr(10), 0, match.start()) + 1}")
    assert not loose, "design.md named without a section or its path docs/design.md:\n" + "\n".join(loose)


@pytest.mark.parametrize("page", ["README.md", "docs/index.md"])
def test_design_is_linked_from_the_front_pages(page):
    assert re.search(r"\]\((?:docs/)?design\.md\)", (REPO / page).read_text(encoding="utf-8")), page


def test_no_tracked_file_sends_a_reader_outside_the_repository():
    here = Path(__file__).relative_to(REPO).as_posix()
    outside = []
    for path in tracked_files():
        rel = path.relative_to(REPO).as_posix()
        text = text_of(path)
        if text is None or rel == here:
            continue
        for match in OUTSIDE.finditer(text):
            outside.append(f"{rel}:{text.count(chr(10), 0, match.start()) + 1}: {match.group(0)}")
    assert not outside, "paths outside the repository:\n" + "\n".join(outside)
