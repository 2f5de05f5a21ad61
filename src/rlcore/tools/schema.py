"""A Python function as an OpenAI function tool: its schema from the signature's type hints and the docstring, and
the check of a call's arguments against that schema before the call is run.

The schema is ``{"type": "function", "function": {"name", "description", "parameters"}}``: the description is
the docstring's first paragraph; each parameter's JSON type comes from its annotation (``str``, ``int``,
``float``, ``bool``, ``list[...]``, ``dict[...]``, ``Literal[...]``, ``X | None``), its description from the
docstring's ``Args:`` section (``name: text``) or ``:param name: text`` lines; a parameter without a default is
required. A parameter without an annotation, or with one this does not map, accepts any JSON value.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from collections.abc import Callable
from typing import Any

#: JSON Schema's type names of Python's plain types (bool before int: a bool is an int in Python, not in JSON).
_JSON_TYPES: tuple[tuple[type, str], ...] = (
    (bool, "boolean"),
    (int, "integer"),
    (float, "number"),
    (str, "string"),
    (list, "array"),
    (tuple, "array"),
    (dict, "object"),
)


def function_schema(fn: Callable[..., Any], name: str | None = None) -> dict[str, Any]:
    """The OpenAI function-tool schema of ``fn`` (named ``name``, default its ``__name__``)."""
    doc = inspect.getdoc(fn) or ""
    hints = typing.get_type_hints(fn)
    described = _parameter_docs(doc)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
            raise ValueError(
                f"tool {fn.__module__}:{fn.__qualname__}: parameter {param.name!r} cannot be passed by name from "
                "JSON arguments; a tool takes named parameters only"
            )
        prop = _json_schema(hints.get(param.name, Any))
        if param.name in described:
            prop["description"] = described[param.name]
        properties[param.name] = prop
        if param.default is param.empty:
            required.append(param.name)
    return {
        "type": "function",
        "function": {
            "name": name or fn.__name__,
            "description": doc.split("\n\n")[0].replace("\n", " ").strip(),
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def _json_schema(annotation: Any) -> dict[str, Any]:
    """The JSON schema of one annotation; ``{}`` (any value) for one it does not map."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return {"enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        return _json_schema(options[0]) if len(options) == 1 else {}
    plain = origin or annotation
    for python_type, json_type in _JSON_TYPES:
        if plain is python_type:
            schema: dict[str, Any] = {"type": json_type}
            if json_type == "array" and args and origin is list:
                schema["items"] = _json_schema(args[0])
            return schema
    return {}


def _parameter_docs(doc: str) -> dict[str, str]:
    """``{parameter: description}`` from a Google-style ``Args:`` section or reST ``:param name:`` lines."""
    found = {m.group(1): m.group(2).strip() for m in re.finditer(r"^\s*:param\s+(\w+):\s*(.+)$", doc, re.M)}
    section = re.search(r"^\s*(?:Args|Arguments|Parameters):\s*\n((?:[ \t]+.+\n?)+)", doc, re.M)
    if section:
        for m in re.finditer(r"^\s+(\w+)(?:\s*\([^)]*\))?:\s*(.+)$", section.group(1), re.M):
            found.setdefault(m.group(1), m.group(2).strip())
    return found


def argument_problems(schema: dict[str, Any], arguments: dict[str, Any]) -> list[str]:
    """Why ``arguments`` do not fit the tool's ``schema`` (missing or unknown names, JSON types, enums); [] when
    they do."""
    params = schema["function"]["parameters"]
    properties: dict[str, Any] = params["properties"]
    problems = [f"missing argument {name!r}" for name in params["required"] if name not in arguments]
    for name, value in arguments.items():
        if name not in properties:
            problems.append(f"unknown argument {name!r} (the tool takes {', '.join(properties) or 'none'})")
            continue
        problem = _value_problem(properties[name], value)
        if problem:
            problems.append(f"argument {name!r}: {problem}")
    return problems


def _value_problem(schema: dict[str, Any], value: Any) -> str | None:
    if "enum" in schema and value not in schema["enum"]:
        return f"{value!r} is not one of {schema['enum']}"
    expected = schema.get("type")
    if (
        expected is None
        or _json_type_of(value) == expected
        or (expected == "number" and _json_type_of(value) == "integer")
    ):
        return None
    return f"expected {expected}, got {_json_type_of(value)}"


def _json_type_of(value: Any) -> str:
    if value is None:
        return "null"
    for python_type, json_type in _JSON_TYPES:
        if isinstance(value, python_type):
            return json_type
    return type(value).__name__


__all__ = ["argument_problems", "function_schema"]
