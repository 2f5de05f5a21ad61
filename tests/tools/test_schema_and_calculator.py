"""A function's OpenAI tool schema from its signature and docstring, the argument check against it, and the built-in
calculator against Python's own arithmetic."""

from __future__ import annotations

from typing import Literal

import pytest

from rlcore.tools.calculator import calculator
from rlcore.tools.schema import argument_problems, function_schema


def search(query: str, limit: int = 5, exact: bool | None = None, tags: list[str] | None = None,
           order: Literal["new", "old"] = "new", weight: float = 1.0) -> list[str]:  # fmt: skip
    """Search the notes.

    Returns the titles of the best matches.

    Args:
        query: the words to look for.
        limit (int): at most this many titles.
    """
    return []


def test_the_schema_follows_the_signature_and_docstring():
    assert function_schema(search) == {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the notes.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "the words to look for."},
                    "limit": {"type": "integer", "description": "at most this many titles."},
                    "exact": {"type": "boolean"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "order": {"enum": ["new", "old"]},
                    "weight": {"type": "number"},
                },
                "required": ["query"],
            },
        },
    }


def test_arguments_are_checked_against_the_schema():
    schema = function_schema(search)
    assert argument_problems(schema, {"query": "x", "limit": 3, "weight": 2}) == []  # an integer is a number
    assert argument_problems(schema, {"limit": True, "colour": "red", "order": "sideways"}) == [
        "missing argument 'query'",
        "argument 'limit': expected integer, got boolean",
        "unknown argument 'colour' (the tool takes query, limit, exact, tags, order, weight)",
        "argument 'order': 'sideways' is not one of ['new', 'old']",
    ]


def test_a_tool_needs_named_parameters():
    def variadic(*values: int) -> int:
        return sum(values)

    with pytest.raises(ValueError, match="'values' cannot be passed by name"):
        function_schema(variadic)


@pytest.mark.parametrize(
    "expression", ["(3 + 4) * 12 / 7", "2 ** 10", "7 / 2", "-3 // 2", "17 % 5", "347*589", "+1.5 - -2", "2**-1"]
)
def test_the_calculator_agrees_with_python(expression):
    expected = eval(expression)  # the reference; the calculator itself never evaluates code
    got = calculator(expression)
    assert float(got) == pytest.approx(expected)
    assert got == (str(int(expected)) if float(expected).is_integer() else str(expected))


@pytest.mark.parametrize(
    ("expression", "error"),
    [
        ("__import__('os').system('true')", "not arithmetic"),
        ("x + 1", "not arithmetic"),
        ("(1).real", "not arithmetic"),
        ("True + 1", "not arithmetic"),
        ("'a' * 3", "not arithmetic"),
        ("9 ** 9 ** 9", "too large"),
    ],
)
def test_the_calculator_refuses_anything_else(expression, error):
    with pytest.raises(ValueError, match=error):
        calculator(expression)
