"""The methods of a worker class read from its source, without importing it (registration must stay light).

Only a class whose whole method set is in its own module can be judged this
way: one without bases, or whose bases are classes of the same module that
are judged the same way. For any other (a base imported from elsewhere, a
``__getattr__``), :func:`defined_methods` says it cannot tell, and the check
waits for the class to be imported: by the conformance kit and by the worker
host before it builds the worker.
"""

from __future__ import annotations

import ast
from pathlib import Path

from rlcore.plugins.spec import find_module_spec


def _source_path(module: str) -> Path | None:
    """The ``.py`` file of ``module``, found without importing it or its packages."""
    origin = getattr(find_module_spec(module), "origin", None)
    return Path(origin) if origin and origin.endswith(".py") else None


def defined_methods(class_path: str) -> set[str] | None:
    """Names defined by the class ``'module:Class'`` and its bases, or None when the source cannot tell."""
    module, _, qualname = class_path.partition(":")
    path = _source_path(module)
    if path is None or "." in qualname:
        return None
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    return _names(qualname, classes, set())


def _names(name: str, classes: dict[str, ast.ClassDef], seen: set[str]) -> set[str] | None:
    node = classes.get(name)
    if node is None or name in seen or node.keywords or node.decorator_list:
        return None  # defined elsewhere, a metaclass, or a decorator that may add methods
    names: set[str] = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(item.name)
        elif isinstance(item, ast.Assign):
            names.update(t.id for t in item.targets if isinstance(t, ast.Name))
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            names.add(item.target.id)
    if "__getattr__" in names:
        return None
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id == "object":
            continue
        inherited = _names(base.id, classes, seen | {name}) if isinstance(base, ast.Name) else None
        if inherited is None:
            return None
        names |= inherited
    return names
