"""Count function parameters, and how many are annotated ``Any``, over rlcore's and its plugins' sources.

The headline (issue 51's measure) is over the named parameters of every ``def``: ``self``, ``cls``, ``*args`` and
``**kwargs`` are left out, and a parameter counts as ``Any`` when its annotation is exactly ``Any`` (or
``typing.Any``, or the string ``"Any"``). A second line counts annotations that mention ``Any`` anywhere
(``dict[str, Any]``, ``Any | None``), and a third the ``*args`` / ``**kwargs``. Usage::

    python scripts/count_annotations.py            # totals over src/ and plugins/*/src
    python scripts/count_annotations.py --by-file  # and one line per file with an Any parameter
    python scripts/count_annotations.py PATH ...   # other roots (files or folders)
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_ROOTS = [REPO / "src", *sorted((REPO / "plugins").glob("*/src"))]


@dataclass
class Counts:
    parameters: int = 0  # named parameters, without self / cls
    annotated: int = 0
    bare_any: int = 0  # annotated exactly Any
    mentions_any: int = 0  # annotation mentions Any anywhere (includes bare_any)
    star_parameters: int = 0  # *args / **kwargs
    star_any: int = 0  # *args / **kwargs whose annotation mentions Any

    def add(self, other: Counts) -> None:
        for name in vars(self):
            setattr(self, name, getattr(self, name) + getattr(other, name))


def _mentions_any(annotation: ast.expr) -> bool:
    for node in ast.walk(annotation):
        if isinstance(node, ast.Name) and node.id == "Any":
            return True
        if isinstance(node, ast.Attribute) and node.attr == "Any":
            return True
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                if _mentions_any(ast.parse(node.value, mode="eval").body):
                    return True
            except SyntaxError:
                continue
    return False


def _is_bare_any(annotation: ast.expr) -> bool:
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return annotation.value.strip() in ("Any", "typing.Any")
    return (isinstance(annotation, ast.Name) and annotation.id == "Any") or (
        isinstance(annotation, ast.Attribute) and annotation.attr == "Any"
    )


def count_source(source: str) -> Counts:
    counts = Counts()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        args = node.args
        for param in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
            if param.arg in ("self", "cls"):
                continue
            counts.parameters += 1
            if param.annotation is None:
                continue
            counts.annotated += 1
            counts.bare_any += _is_bare_any(param.annotation)
            counts.mentions_any += _mentions_any(param.annotation)
        for star in (args.vararg, args.kwarg):
            if star is not None:
                counts.star_parameters += 1
                counts.star_any += star.annotation is not None and _mentions_any(star.annotation)
    return counts


def python_files(roots: list[Path]) -> list[Path]:
    files: list[Path] = []
    for root in roots:
        files.extend([root] if root.is_file() else sorted(root.rglob("*.py")))
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", nargs="*", type=Path, help="files or folders (default: src/ and plugins/*/src)")
    parser.add_argument("--by-file", action="store_true", help="one line per file that has an Any parameter")
    options = parser.parse_args(argv)
    total = Counts()
    for path in python_files(options.roots or DEFAULT_ROOTS):
        counts = count_source(path.read_text(encoding="utf-8"))
        total.add(counts)
        if options.by_file and counts.bare_any:
            shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
            print(f"{counts.bare_any:4d} / {counts.parameters:4d}  {shown}")
    print(
        f"parameters: {total.parameters} (annotated {total.annotated}), typed Any: {total.bare_any} "
        f"({_share(total.bare_any, total.parameters)})"
    )
    print(f"annotations that mention Any (dict[str, Any], Any | None, ...): {total.mentions_any}")
    print(f"*args / **kwargs: {total.star_parameters}, of which mention Any: {total.star_any}")
    return 0


def _share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


if __name__ == "__main__":
    sys.exit(main())
