"""The keyword arguments a class accepts, read from its source file without importing it.

``policy.optimizer.kwargs`` and ``policy.scheduler[i].kwargs`` are passed to
classes named by import path (``torch.optim.AdamW``) inside the workers. A
typo there (``weigth_decay``) used to validate and fail only inside a worker;
checking it at load would mean importing torch (seconds, and the config path
stays light) and running module code named in a config file. Instead the
class is found on disk (``importlib.util.find_spec`` of the top-level
package, which imports nothing, then the package directories), its module
parsed with :mod:`ast`, re-exports (``from .adamw import AdamW``) and base
classes followed, and the parameters of its ``__init__`` read. When the
source cannot be read that way (a C extension, a dynamic attribute) the
answer is ``None``: "cannot tell", and the worker's own call is the check.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

_MAX_DEPTH = 12


@dataclass(frozen=True)
class InitSignature:
    """What ``cls(positional, **kwargs)`` accepts as keyword arguments."""

    qualname: str
    names: tuple[str, ...]  # parameter names in order, self excluded
    positional_only: frozenset[str]
    var_keyword: bool  # has **kwargs: any name is accepted

    def unknown(self, keys: list[str], skip_first: int = 1) -> list[str]:
        """``keys`` that cannot be passed as keyword arguments; the first ``skip_first`` parameters
        are the ones rlcore passes itself (the parameters, the optimizer)."""
        allowed = {n for n in self.names[skip_first:] if n not in self.positional_only}
        taken = set(self.names[:skip_first])
        return [k for k in keys if k in taken or (k not in allowed and not self.var_keyword)]


def _module_file(module: str) -> Path | None:
    """The source file of ``module`` (a package's ``__init__.py``), found without importing anything."""
    loaded = sys.modules.get(module)
    if loaded is not None:
        file = getattr(loaded, "__file__", None)
        return Path(file) if file and file.endswith(".py") else None
    top, *rest = module.split(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if not rest:
        return Path(spec.origin) if spec.origin and spec.origin.endswith(".py") else None
    dirs = [Path(p) for p in (spec.submodule_search_locations or [])]
    for i, part in enumerate(rest):
        last = i == len(rest) - 1
        found: Path | None = None
        next_dirs: list[Path] = []
        for d in dirs:
            if (d / part / "__init__.py").is_file():
                found = d / part / "__init__.py"
                next_dirs.append(d / part)
            elif (d / part).is_dir():  # namespace package
                next_dirs.append(d / part)
            elif last and (d / f"{part}.py").is_file():
                found = d / f"{part}.py"
        if last:
            return found
        dirs = next_dirs
        if not dirs:
            return None
    return None


@lru_cache(maxsize=64)
def _parse(path: Path) -> ast.Module | None:
    try:
        return ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None


def _top_level(tree: ast.Module) -> list[ast.stmt]:
    """Module statements, including those inside top-level ``if``/``try`` blocks."""
    out: list[ast.stmt] = []
    stack = list(tree.body)
    while stack:
        node = stack.pop(0)
        out.append(node)
        if isinstance(node, ast.If):
            stack[:0] = node.body + node.orelse
        elif isinstance(node, ast.Try):
            stack[:0] = node.body + [s for h in node.handlers for s in h.body] + node.orelse + node.finalbody
    return out


def _absolute(module: str, is_package: bool, imported: str | None, level: int) -> str:
    if level == 0:
        return imported or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([imported] if imported else []))


def _find_class(module: str, name: str, depth: int) -> tuple[str, ast.ClassDef] | None:
    """``(module that defines it, its ClassDef)`` for ``module.name``, following imports."""
    if depth > _MAX_DEPTH:
        return None
    path = _module_file(module)
    if path is None:
        return None
    tree = _parse(path)
    if tree is None:
        return None
    is_package = path.name == "__init__.py"
    for node in reversed(_top_level(tree)):  # the last binding of a name wins
        if isinstance(node, ast.ClassDef) and node.name == name:
            return module, node
        if isinstance(node, ast.ImportFrom):
            source = _absolute(module, is_package, node.module, node.level)
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    found = _find_class(source, alias.name, depth + 1)
                    if found is None and _module_file(f"{source}.{alias.name}") is not None:
                        return None  # a submodule, not a class
                    return found
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name):
            if any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                return _find_class(module, node.value.id, depth + 1)
    # ``from .x import *``: look through the star-imported modules.
    for node in _top_level(tree):
        if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
            found = _find_class(_absolute(module, is_package, node.module, node.level), name, depth + 1)
            if found is not None:
                return found
    return None


def _base_ref(module: str, base: ast.expr) -> tuple[str, str] | None:
    """``(module, name)`` to look a base class up in."""
    if isinstance(base, ast.Name):
        return module, base.id
    if isinstance(base, ast.Attribute):
        parts: list[str] = []
        node: ast.expr = base
        while isinstance(node, ast.Attribute):
            parts.insert(0, node.attr)
            node = node.value
        if isinstance(node, ast.Name):
            parts.insert(0, node.id)
            return ".".join(parts[:-1]), parts[-1]
    return None


def _signature(module: str, cls: ast.ClassDef, depth: int) -> InitSignature | None:
    if depth > _MAX_DEPTH:
        return None
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "__init__":
            a = node.args
            names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs][1:]  # drop self
            posonly = frozenset(p.arg for p in a.posonlyargs[1:])
            return InitSignature(f"{module}.{cls.name}", tuple(names), posonly, a.kwarg is not None)
    if any(isinstance(d, (ast.Name, ast.Attribute, ast.Call)) for d in cls.decorator_list):
        return None  # e.g. a dataclass: the __init__ is generated
    real_bases = [
        b
        for b in cls.bases
        if not (isinstance(b, ast.Name) and b.id in ("object", "Generic")) and not isinstance(b, ast.Subscript)
    ]
    if not real_bases:
        return InitSignature(f"{module}.{cls.name}", (), frozenset(), False)
    ref = _base_ref(module, real_bases[0])
    if ref is None:
        return None
    found = _find_class(ref[0], ref[1], depth + 1)
    if found is None and ref[0] != module:
        return None
    if found is None:
        return None
    inherited = _signature(found[0], found[1], depth + 1)
    if inherited is None:
        return None
    return InitSignature(f"{module}.{cls.name}", inherited.names, inherited.positional_only, inherited.var_keyword)


def init_signature(path: str, default_module: str) -> InitSignature | None:
    """The ``__init__`` parameters of the class at import path ``path`` (a bare name is looked up in
    ``default_module``); ``None`` when that cannot be read from source."""
    module, _, name = path.rpartition(".")
    found = _find_class(module or default_module, name, 0)
    return _signature(found[0], found[1], 0) if found else None


__all__ = ["InitSignature", "init_signature"]
