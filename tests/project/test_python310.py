"""``requires-python = ">=3.10"`` holds: no source file uses syntax or stdlib names newer than 3.10.

There is no 3.10 interpreter on the development machines, so this is a static
check: every file parses with ``feature_version=(3, 10)`` (which rejects
``except*`` and other 3.11+ grammar), and no 3.11+ standard-library name is
imported or used outside an ``if sys.version_info >= (3, 11):`` branch.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

#: module -> names that first appeared in Python 3.11 (or later).
NEW_NAMES: dict[str, set[str]] = {
    "typing": {
        "NotRequired",
        "Required",
        "Self",
        "LiteralString",
        "Never",
        "assert_never",
        "assert_type",
        "reveal_type",
        "dataclass_transform",
        "TypeVarTuple",
        "Unpack",
        "get_overloads",
        "clear_overloads",
        "override",
        "TypeAliasType",
        "ReadOnly",
        "TypeIs",
    },
    "enum": {"StrEnum", "verify", "member", "nonmember", "global_enum", "EnumCheck", "ReprEnum"},
    "datetime": {"UTC"},
    "asyncio": {"TaskGroup", "timeout", "timeout_at", "Runner", "Barrier"},
    "hashlib": {"file_digest"},
    "contextlib": {"chdir"},
    "itertools": {"batched"},
    "operator": {"call"},
}
NEW_MODULES = {"tomllib", "wsgiref.types"}
NEW_BUILTINS = {"ExceptionGroup", "BaseExceptionGroup"}


def _sources() -> list[Path]:
    roots = [REPO / "src", REPO / "tests", REPO / "examples", *sorted((REPO / "plugins").glob("*"))]
    files = [REPO / "conftest.py"]
    for root in roots:
        files += [p for p in root.rglob("*.py") if ".venv" not in p.parts]
    return sorted(set(files))


def _is_version_guard(test: ast.expr) -> bool:
    """``sys.version_info >= (3, 11)`` (or ``> (3, 10)``), the guard that makes new names fine."""
    return isinstance(test, ast.Compare) and isinstance(test.left, ast.Attribute) and test.left.attr == "version_info"


class _Finder(ast.NodeVisitor):
    def __init__(self) -> None:
        self.found: list[str] = []

    def visit_If(self, node: ast.If) -> None:
        if _is_version_guard(node.test):
            for child in node.orelse:  # only the < 3.11 branch must be 3.10-clean
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Try(self, node: ast.Try) -> None:
        # ``try: from typing import X / except ImportError: ...`` is a fallback, not a requirement.
        catches_import = any(
            isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError") for h in node.handlers
        )
        for child in ([] if catches_import else node.body) + node.handlers + node.orelse + node.finalbody:
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name in NEW_MODULES:
                self.found.append(f"line {node.lineno}: import {alias.name}")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module in NEW_MODULES:
            self.found.append(f"line {node.lineno}: from {node.module} import ...")
        for alias in node.names:
            if alias.name in NEW_NAMES.get(node.module or "", ()):
                self.found.append(f"line {node.lineno}: from {node.module} import {alias.name}")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.value, ast.Name) and node.attr in NEW_NAMES.get(node.value.id, ()):
            self.found.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if node.id in NEW_BUILTINS:
            self.found.append(f"line {node.lineno}: {node.id}")


def test_sources_are_python_310_compatible() -> None:
    problems = []
    for path in _sources():
        rel = path.relative_to(REPO)
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path), feature_version=(3, 10))
        except SyntaxError as exc:
            problems.append(f"{rel}:{exc.lineno}: not Python 3.10 syntax: {exc.msg}")
            continue
        finder = _Finder()
        finder.visit(tree)
        problems += [f"{rel}: {found}" for found in finder.found]
    assert not problems, "3.11+ syntax or names (requires-python is >=3.10):\n" + "\n".join(problems)


def test_the_finder_catches_what_it_is_for() -> None:
    bad = "from typing import NotRequired\nimport tomllib\nx = ExceptionGroup\nimport datetime\ny = datetime.UTC\n"
    finder = _Finder()
    finder.visit(ast.parse(bad))
    assert len(finder.found) == 4, finder.found
    guarded = (
        "import sys\nif sys.version_info >= (3, 11):\n    from typing import NotRequired\n"
        "else:\n    from typing_extensions import NotRequired\n"
    )
    finder = _Finder()
    finder.visit(ast.parse(guarded))
    assert finder.found == []
    with pytest.raises(SyntaxError):
        ast.parse("try:\n    pass\nexcept* ValueError:\n    pass\n", feature_version=(3, 10))


def test_every_distribution_declares_the_same_python_floor() -> None:
    tomllib = pytest.importorskip("tomllib")  # 3.11+; the check itself needs no 3.10 run
    floors = {}
    for pyproject in [
        REPO / "pyproject.toml",
        *sorted(REPO.glob("plugins/*/pyproject.toml")),
        REPO / "examples" / "plugin-template" / "pyproject.toml",
    ]:
        floors[str(pyproject.relative_to(REPO))] = tomllib.loads(pyproject.read_text())["project"]["requires-python"]
    assert set(floors.values()) == {">=3.10"}, floors
