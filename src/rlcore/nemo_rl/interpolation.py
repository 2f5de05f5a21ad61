"""OmegaConf-style ``${...}`` interpolation, the subset NeMo-RL's configs use.

- ``${policy.max_total_sequence_length}``: another value of the config, by
  absolute dotted path (``a.b[0].c`` or ``a.b.0.c``);
- ``${.x}``, ``${..x}``: relative to the mapping that holds the value (one more
  dot per level up), as in OmegaConf;
- ``${mul:a,b}``, ``${div:a,b}``, ``${max:a,b}``: NeMo-RL's resolvers
  (``nemo_rl.utils.config.register_omegaconf_resolvers``); ``${oc.env:VAR}``,
  ``${oc.env:VAR,default}`` and ``${oc.select:path,default}`` from OmegaConf;
  arguments may be interpolations themselves.

A value that is exactly one interpolation takes the referenced value's type
(``${policy.max_total_sequence_length}`` is an int); interpolations inside a
longer string are formatted into it. Every problem is one line naming the
dotted path of the value that holds the interpolation.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

from rlcore.config.errors import ConfigError
from rlcore.config.messages import join_path

Path = tuple[Any, ...]  # keys and list indices
_MISSING = object()


class _Problem(Exception):
    pass


def _number(value: Any, what: str) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Problem(f"{what} needs numbers, got {value!r}")
    return value


def _env(name: Any, default: Any = _MISSING) -> Any:
    value = os.environ.get(str(name))
    if value is not None:
        return value
    if default is _MISSING:
        raise _Problem(f"environment variable {name} is not set (and no default is given)")
    return default


RESOLVERS: dict[str, Callable[..., Any]] = {
    "mul": lambda a, b: _number(a, "mul") * _number(b, "mul"),
    "div": lambda a, b: _number(a, "div") / _number(b, "div"),
    "max": lambda a, b: max(_number(a, "max"), _number(b, "max")),
    "oc.env": _env,
}
#: Resolver names and what they do, for the docs.
RESOLVER_DOCS = {
    "mul": "a * b (NeMo-RL)",
    "div": "a / b (NeMo-RL)",
    "max": "max(a, b) (NeMo-RL)",
    "oc.env": "environment variable, with an optional default (OmegaConf)",
    "oc.select": "another value by path, with a default when it is missing (OmegaConf)",
}


def _scan(text: str, start: int) -> int:
    """Index just past the ``}`` closing the ``${`` at ``start`` (nested ``${...}`` counted)."""
    depth, i = 0, start
    while i < len(text):
        if text.startswith("${", i):
            depth += 1
            i += 2
            continue
        if text[i] == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise _Problem(f"unclosed '${{' in {text!r}")


def _split_args(text: str) -> list[str]:
    """Split resolver arguments on top-level commas."""
    args, depth, quote, current = [], 0, None, ""
    for c in text:
        if quote:
            current += c
            if c == quote:
                quote = None
            continue
        if c in "'\"":
            quote = c
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
        elif c == "," and depth == 0:
            args.append(current)
            current = ""
            continue
        current += c
    args.append(current)
    return [a.strip() for a in args]


def _literal(text: str) -> Any:
    """A resolver argument written literally: number, bool, null or (quoted) string."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("null", "none", "~"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


_PATH_TOKEN = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def _parse_path(text: str) -> list[Any]:
    parts: list[Any] = []
    for name, index in _PATH_TOKEN.findall(text):
        parts.append(int(index) if index else (int(name) if name.isdigit() else name))
    return parts


class Resolver:
    """Resolves every interpolation of one config dict (lazily, with cycle detection)."""

    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.resolving: list[Path] = []
        self.done: dict[Path, Any] = {}

    # -- lookups -----------------------------------------------------------------------
    def _get(self, path: Path) -> Any:
        node: Any = self.root
        for part in path:
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, dict) and str(part) in node:
                node = node[str(part)]
            elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
                node = node[part]
            else:
                return _MISSING
        return node

    def value(self, path: Path) -> Any:
        """The fully resolved value at ``path``."""
        if path in self.done:
            return self.done[path]
        if path in self.resolving:
            cycle = " -> ".join(join_path("", list(p)) for p in [*self.resolving[self.resolving.index(path) :], path])
            raise _Problem(f"interpolation cycle: {cycle}")
        raw = self._get(path)
        if raw is _MISSING:
            raise _Problem(f"'{join_path('', list(path))}' does not exist")
        self.resolving.append(path)
        try:
            if isinstance(raw, dict):
                result: Any = {k: self.value((*path, k)) for k in raw}
            elif isinstance(raw, list):
                result = [self.value((*path, i)) for i in range(len(raw))]
            elif isinstance(raw, str) and "${" in raw:
                result = self._string(raw, path)
            else:
                result = raw
        finally:
            self.resolving.pop()
        self.done[path] = result
        return result

    # -- interpolation -------------------------------------------------------------------
    def _string(self, text: str, where: Path) -> Any:
        pieces: list[Any] = []
        i = 0
        while i < len(text):
            j = text.find("${", i)
            if j < 0 or (j > 0 and text[j - 1] == "\\"):
                if j < 0:
                    pieces.append(text[i:])
                    break
                pieces.append(text[i : j - 1] + "${")
                i = j + 2
                continue
            pieces.append(text[i:j])
            end = _scan(text, j)
            pieces.append((self._expression(text[j + 2 : end - 1], where),))
            i = end
        parts = [p for p in pieces if p != ""]
        if len(parts) == 1 and isinstance(parts[0], tuple):
            return parts[0][0]  # exactly one interpolation: keep its type
        return "".join(str(p[0]) if isinstance(p, tuple) else p for p in parts)

    def _argument(self, text: str, where: Path) -> Any:
        return self._string(text, where) if "${" in text else _literal(text)

    def _expression(self, expr: str, where: Path) -> Any:
        expr = expr.strip()
        head = re.match(r"^([A-Za-z_][\w.]*):", expr)
        if head and not expr.startswith("."):
            name, rest = head.group(1), expr[head.end() :]
            args = [self._argument(a, where) for a in _split_args(rest)] if rest.strip() else []
            if name == "oc.select":
                target = self._reference(str(args[0]), where, missing_ok=True) if args else _MISSING
                return args[1] if target is _MISSING and len(args) > 1 else (None if target is _MISSING else target)
            fn = RESOLVERS.get(name)
            if fn is None:
                raise _Problem(f"unknown resolver '{name}' (rlcore knows {', '.join(sorted(RESOLVER_DOCS))})")
            try:
                return fn(*args)
            except TypeError:
                raise _Problem(f"wrong number of arguments for '{name}' ({len(args)} given)") from None
        return self._reference(expr, where)

    def _reference(self, expr: str, where: Path, missing_ok: bool = False) -> Any:
        dots = len(expr) - len(expr.lstrip("."))
        if dots:
            base = list(where[:-1])  # the mapping holding the value
            up = dots - 1
            if up > len(base):
                raise _Problem(f"'{expr}' goes above the top of the config")
            base = base[: len(base) - up]
            path = (*base, *_parse_path(expr[dots:]))
        else:
            path = tuple(_parse_path(expr))
        if missing_ok and self._get(path) is _MISSING:
            return _MISSING
        return self.value(path)


def resolve(config: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``config`` with every interpolation resolved; all problems in one ConfigError."""
    resolver = Resolver(config)
    problems: list[str] = []
    out: dict[str, Any] = {}

    def walk(node: Any, path: Path) -> Any:
        if isinstance(node, dict):
            return {k: walk(v, (*path, k)) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v, (*path, i)) for i, v in enumerate(node)]
        if node == "???":  # OmegaConf's mandatory value
            problems.append(
                f"{join_path('', list(path))}: is '???' (a value the config leaves to you): set it "
                "with an override, e.g. " + join_path("", list(path)) + "=..."
            )
            return None
        if isinstance(node, str) and "${" in node:
            try:
                return resolver.value(path)
            except _Problem as exc:
                problems.append(f"{join_path('', list(path))}: cannot resolve {node!r}: {exc}")
                return None
        return node

    out = walk(config, ())
    if problems:
        raise ConfigError(problems)
    return out


__all__ = ["RESOLVERS", "RESOLVER_DOCS", "resolve"]
