"""The built-in ``calculator`` tool: arithmetic on numbers, evaluated by walking Python's syntax tree (no eval)."""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable

_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[float], float]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}

#: The most digits a power may have (about digits of the base times the exponent): more would take the
#: sandbox's whole time, and Python does not print an int of over 4300 digits.
_MAX_POWER_DIGITS = 4000


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.

    Args:
        expression: the expression, e.g. "(3 + 4) * 12 / 7".
    """
    tree = ast.parse(expression.strip(), mode="eval")
    value = _evaluate(tree.body)
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return str(value)


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and len(str(int(abs(left)))) * abs(right) > _MAX_POWER_DIGITS:
            raise ValueError(f"{left} ** {right} is too large to compute")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"not arithmetic: {ast.unparse(node)!r} (numbers, + - * / // % ** and parentheses only)")


__all__ = ["calculator"]
