"""Turn pydantic validation errors into one human line per problem.

Each line is ``<dotted.path>: <what is wrong>``. The path is rebuilt by walking
the model classes along the error location, which lets us (a) drop the
internal parts pydantic adds (union member tags, the ``backend_sections``
field that ``*_cfg`` keys are collected into) and (b) find the model an
unknown key was written in, to suggest the closest valid key.
"""

from __future__ import annotations

import difflib
import json
import types
import typing
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ValidationError

from rlcore.config.base import SECTIONS_FIELD

# What a pydantic error type expected, in words. Types missing here fall back
# to pydantic's own message with "Input should be" turned into "expected".
_EXPECTED = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer (no fractional part)",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "tuple_type": "a list",
    "dict_type": "a mapping (key: value)",
    "model_type": "a mapping (key: value)",
    "model_attributes_type": "a mapping (key: value)",
    "none_required": "null",
}
_COMPARISONS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


def _unwrap(tp: Any) -> Any:
    """Strip ``Annotated`` and ``Optional`` layers."""
    while True:
        origin = typing.get_origin(tp)
        if origin is typing.Annotated:
            tp = typing.get_args(tp)[0]
        elif origin in (typing.Union, types.UnionType):
            members = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(members) != 1:
                return tp
            tp = members[0]
        else:
            return tp


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _union_member(tp: Any, tag: str) -> Any:
    for member in typing.get_args(tp):
        member = _unwrap(member)
        if getattr(member, "__name__", None) == tag:
            return member
    return None


def _walk(root: type[BaseModel], loc: tuple[Any, ...]) -> tuple[list[str | int], type[BaseModel] | None]:
    """Map an error location to display parts, and the model holding its last key."""
    parts: list[str | int] = []
    current: Any = root
    owner: type[BaseModel] | None = root
    for item in loc:
        if item == "[key]":
            continue  # pydantic's marker for "the key itself is invalid"; the key is already in the path
        current = _unwrap(current)
        origin = typing.get_origin(current)
        if origin in (typing.Union, types.UnionType) and isinstance(item, str):
            current = _union_member(current, item)  # a union member tag: not part of the path
            owner = current if _is_model(current) else None
            continue
        owner = current if _is_model(current) else None
        is_index = isinstance(item, int) and origin in (list, tuple)
        parts.append(item if is_index else str(item))
        if _is_model(current):
            if item == SECTIONS_FIELD:
                parts.pop()  # `*_cfg` keys live under their own name in the file
                current = current.model_fields[item].annotation
            elif isinstance(item, str) and item in current.model_fields:
                current = current.model_fields[item].annotation
            else:
                current = None
        elif origin in (list, tuple) and isinstance(item, int):
            args = typing.get_args(current)
            current = args[0] if args else None
        elif origin is dict:
            args = typing.get_args(current)
            current = args[1] if len(args) == 2 else None
        else:
            current = None
    return parts, owner


def join_path(prefix: str, parts: Iterable[str | int]) -> str:
    """``('a', 0, 'b')`` under prefix ``x`` -> ``x.a[0].b``."""
    out = prefix
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out = f"{out}.{part}" if out else str(part)
    return out or "(top level)"


def show_value(value: Any, limit: int = 60) -> str:
    """A value as the user would have written it: strings quoted, YAML null/true/false."""
    if isinstance(value, str):
        text = "'" + value.replace("'", "\\'") + "'"
    elif value is None:
        text = "null"
    elif isinstance(value, bool):
        text = "true" if value else "false"
    else:
        try:
            text = json.dumps(value, default=str)
        except (TypeError, ValueError):
            text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _expected(err: dict[str, Any]) -> str | None:
    """What was expected, in words; None when pydantic's message is not of that shape."""
    kind = err["type"]
    ctx = err.get("ctx") or {}
    if kind in _EXPECTED:
        return _EXPECTED[kind]
    if kind in _COMPARISONS:
        bound = next(iter(ctx.values()), "?")
        if isinstance(bound, float) and bound.is_integer():
            bound = int(bound)  # `> 0`, not `> 0.0`, so float and int alternatives merge
        return f"a value {_COMPARISONS[kind]} {bound}"
    if kind == "literal_error":
        return "one of " + str(ctx.get("expected", "?"))
    msg = err.get("msg", "")
    if msg.startswith("Input should be "):
        return msg[len("Input should be ") :]
    return None


def _merge_expected(phrases: list[str]) -> str:
    unique = list(dict.fromkeys(phrases))
    if "a number" in unique and "an integer" in unique:
        unique.remove("an integer")  # `float | int`: a number covers both
    return " or ".join(unique)


def unknown_key_text(key: Any, owner: type[BaseModel] | None) -> str:
    """``unknown key``, with the closest key ``owner`` reads when one is close."""
    valid = sorted(k for k in (owner.model_fields if owner else ()) if k != SECTIONS_FIELD)
    close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
    return "unknown key" + (f"; did you mean '{close[0]}'?" if close else "")


def problems_from_validation_error(exc: ValidationError, root: type[BaseModel], prefix: str = "") -> list[str]:
    """One line per problem (pydantic's order); union alternatives for one value are merged."""
    grouped: dict[str, dict[str, Any]] = {}
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        kind = err["type"]
        if kind == "extra_forbidden":
            parts, owner = _walk(root, loc)
            path = join_path(prefix, parts)
            grouped.setdefault(path, {"text": f"{path}: {unknown_key_text(loc[-1], owner)}"})
            continue
        parts, _ = _walk(root, loc)
        path = join_path(prefix, parts)
        if kind == "missing":
            grouped.setdefault(path, {"text": f"{path}: required key is missing"})
            continue
        if kind in ("value_error", "assertion_error"):
            msg = str((err.get("ctx") or {}).get("error", err["msg"]))
            grouped.setdefault(path, {"text": f"{path}: {msg}"})
            continue
        expected = _expected(err)
        if expected is None:  # e.g. "Keys should be strings"
            msg = err["msg"][:1].lower() + err["msg"][1:]
            grouped.setdefault(path, {"text": f"{path}: {msg}, got {show_value(err.get('input'))}"})
            continue
        entry = grouped.setdefault(path, {"expected": [], "value": err.get("input")})
        if "expected" in entry:
            entry["expected"].append(expected)
    lines = []
    for path, entry in grouped.items():
        if "text" in entry:
            lines.append(entry["text"])
        else:
            lines.append(f"{path}: expected {_merge_expected(entry['expected'])}, got {show_value(entry['value'])}")
    return lines
