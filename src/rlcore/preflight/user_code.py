"""Functions and classes a config names as ``'module:name'`` (a reward function, an environment class, a prompt
generator): found before anything starts, under the key that names them.

Found without running the user's code where the source shows it: the module is located without importing it
(:func:`rlcore.plugins.spec.find_module_spec`), and its source is read for a top-level ``def`` or ``class`` of
that name, and for top-level imports of modules that are not installed. Only when the source cannot tell (the
name is assigned, star-imported, re-exported, or missing) is the module imported, as the run would import it:
importing is then the only way to be sure, and a module that fails to import is reported with its error.
"""

from __future__ import annotations

import ast
import difflib
import traceback
from importlib.machinery import ModuleSpec
from pathlib import Path


def import_from_working_directory() -> None:
    """Put the working directory on this process's import path, last, as ``python -m`` and Ray's workers have it:
    ``rlcore run -o env.python_cfg.reward=my_task:reward`` finds ``./my_task.py`` (docs/tasks.md). Last, so a
    file there never hides an installed module of the same name."""
    import os
    import sys

    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


def import_path_problems(key: str, path: str, what: str, fix: str = "", subject: str = "") -> list[str]:
    """Why ``path`` (``'module:name'``, set at config ``key``) is not a ``what`` (``'function'``, ``'class'``)
    the run can import; empty when it is. ``fix``: how to fix a module that is not found (default: where to
    put it); ``subject``: what names ``path`` when the config does not (a plugin's environment), said first."""
    lines = _problems(key, path, what, fix)
    return [line.replace(f"{key}: ", f"{key}: {subject}", 1) for line in lines] if subject else lines


def _problems(key: str, path: str, what: str, fix: str) -> list[str]:
    from rlcore.plugins.spec import find_module_spec

    module, sep, name = path.partition(":")
    if not sep or not module or not name:
        return [
            f"{key}: {path!r} is not 'module:{what}'; write the module's import name, a colon and the {what}'s "
            f"name, e.g. my_rewards:score"
        ]
    spec = find_module_spec(module)
    if spec is None:
        fix = fix or (
            f"put {module.replace('.', '/')}.py in the directory you run from, add its directory to "
            "PYTHONPATH, or install its package"
        )
        return [f"{key}: no module named '{module}' (from {path!r}); {fix}"]
    source = _source(spec)
    if source is not None:
        facts = _top_level(source)
        if facts is not None:
            missing = [m for m in facts.imports if find_module_spec(m) is None]
            if missing:
                return [f"{key}: {_where(spec)} imports '{missing[0]}', which is not installed; install it"]
            if "." not in name and facts.defined.get(name) in ("def", "class"):
                return _kind_problem(key, path, what, facts.defined[name])
    return _imported_problems(key, path, what, module, name, spec)


class _Facts:
    def __init__(self) -> None:
        self.defined: dict[str, str] = {}  # top-level name -> 'def', 'class' or 'other'
        self.imports: list[str] = []  # absolute modules imported at top level (outside try blocks)


def _top_level(source: str) -> _Facts | None:
    """What a module's top level defines and imports; None when it cannot be parsed."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    facts = _Facts()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            facts.defined[node.name] = "def"
        elif isinstance(node, ast.ClassDef):
            facts.defined[node.name] = "class"
        elif isinstance(node, ast.Import):
            facts.imports += [alias.name for alias in node.names]
            facts.defined.update({(a.asname or a.name.split(".")[0]): "other" for a in node.names})
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module and node.module != "__future__":
                facts.imports.append(node.module)
            facts.defined.update({(a.asname or a.name): "other" for a in node.names})
    return facts


def _kind_problem(key: str, path: str, what: str, kind: str) -> list[str]:
    if what == "class" and kind == "def":
        return [f"{key}: {path!r} is a function, not a class"]
    return []


def _imported_problems(key: str, path: str, what: str, module: str, name: str, spec: ModuleSpec) -> list[str]:
    """Import the module (the source could not tell) and look the name up."""
    import importlib

    try:
        obj: object = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - whatever the user's module raises, it is one line
        return [f"{key}: importing '{module}' failed: {_error(exc)}; fix the module"]
    for i, part in enumerate(name.split(".")):
        if not hasattr(obj, part):
            known = [n for n in dir(obj) if not n.startswith("_")]
            close = difflib.get_close_matches(part, known, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            owner = f"'{module}'" if i == 0 else f"'{module}:{'.'.join(name.split('.')[:i])}'"
            return [f"{key}: {owner} ({_where(spec)}) has no {what} '{part}'{hint}"]
        obj = getattr(obj, part)
    if what == "class" and not isinstance(obj, type):
        return [f"{key}: {path!r} is {_a(type(obj).__name__)}, not a class"]
    if not callable(obj):
        return [f"{key}: {path!r} is {_a(type(obj).__name__)}, not a {what}"]
    return []


def _source(spec: ModuleSpec) -> str | None:
    origin = getattr(spec, "origin", None)
    if not origin or not str(origin).endswith(".py"):
        return None
    try:
        return Path(origin).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def _where(spec: ModuleSpec) -> str:
    return str(getattr(spec, "origin", None) or spec.name)


def _error(exc: BaseException) -> str:
    """The error in one line, with the file and line of the user's code that raised it."""
    text = " ".join(str(exc).split())[:200]
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ else []
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"SyntaxError: {exc.msg} (at {exc.filename}:{exc.lineno})"
    frames = [f for f in frames if "importlib" not in f.filename]
    at = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {text}{at}"


def _a(noun: str) -> str:
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


__all__ = ["import_from_working_directory", "import_path_problems"]
