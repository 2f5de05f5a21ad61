"""A calculator task for tool-calling runs: multiply two 3-digit numbers, with or without the calculator.

:func:`calculator_questions` makes the GRPO prompts (``data.train: {generator: ...}``):
``"compute 347*589"`` with the product as the sample's ``ground_truth``. A tiny model
cannot guess a 6-digit product; it gets it right only by calling the ``calculator``
tool and copying the tool's answer.

A randomly initialised byte-level model never writes a Hermes tool call
(``<tool_call>{"name": "calculator", "arguments": {"expression": "347*589"}}</tool_call>``,
about 90 bytes) by chance, so RL alone has nothing to reinforce.
:func:`calculator_demonstrations` makes the conversations of a short SFT warm start
(``grpo_tools_tiny_sft``), deliberately imperfect so that the GRPO run after it has
something to fix: a share of them copy an operand wrong (a valid call, a wrong
answer), write a malformed call (no closing brace), or guess without the tool.
"""

from __future__ import annotations

import json
import random
from typing import Any

#: The tool the demonstrations call; ``env.tools_cfg`` of the example offers the built-in calculator by this name.
TOOL_NAME = "calculator"

#: The kinds of demonstration, in the order :func:`demonstration_kind` draws them.
KINDS = ("correct", "wrong_operand", "malformed_call", "no_tool")


def _operands(rng: random.Random, digits: int) -> tuple[int, int]:
    low, high = 10 ** (digits - 1), 10**digits - 1
    return rng.randint(low, high), rng.randint(low, high)


def question(a: int, b: int) -> str:
    """The prompt of one sample."""
    return f"compute {a}*{b}"


def tool_call_text(expression: str) -> str:
    """A Hermes-format call of the calculator (what the hermes parser reads back)."""
    body = json.dumps({"name": TOOL_NAME, "arguments": {"expression": expression}})
    return f"<tool_call>{body}</tool_call>"


def calculator_questions(step: int, n: int, seed: int = 0, digits: int = 3) -> list[dict[str, str]]:
    """``n`` questions for training step ``step``: the prompt and the product (the sample's answer)."""
    rng = random.Random(seed * 1_000_003 + step)
    rows = []
    for _ in range(n):
        a, b = _operands(rng, digits)
        rows.append({"input": question(a, b), "output": str(a * b)})
    return rows


def demonstration_kind(rng: random.Random, flawed: float) -> str:
    """``correct`` with probability ``1 - flawed``, else one of the flawed kinds, alike."""
    return "correct" if rng.random() >= flawed else rng.choice(KINDS[1:])


def demonstration(a: int, b: int, kind: str, rng: random.Random) -> list[dict[str, str]]:
    """One conversation of kind ``kind`` (:data:`KINDS`) about ``a*b``; the tool's message is its bare result."""
    user = {"role": "user", "content": question(a, b)}
    if kind == "no_tool":
        guess = str(a * b + rng.choice([-1, 1]) * rng.randint(1, 999))
        return [user, {"role": "assistant", "content": guess}]
    if kind == "malformed_call":
        broken = tool_call_text(f"{a}*{b}").replace("}}", "}", 1)
        return [user, {"role": "assistant", "content": broken}]
    if kind == "wrong_operand":
        a_text = list(str(a))
        at = rng.randrange(len(a_text))
        a_text[at] = str((int(a_text[at]) + rng.randint(1, 9)) % 10)
        a = int("".join(a_text)) or a  # a leading zero still parses as a number
    expression = f"{a}*{b}"
    result = str(eval_product(expression))
    return [
        user,
        {"role": "assistant", "content": tool_call_text(expression)},
        {"role": "tool", "content": result},
        {"role": "assistant", "content": result},
    ]


def eval_product(expression: str) -> int:
    """The value of ``"a*b"`` (the demonstrations' only expressions)."""
    a, b = expression.split("*")
    return int(a) * int(b)


def calculator_demonstrations(
    step: int, n: int, seed: int = 0, digits: int = 3, flawed: float = 0.3
) -> list[dict[str, Any]]:
    """``n`` SFT conversations for step ``step`` (``{"messages": [...]}`` rows); a share ``flawed`` are imperfect."""
    rng = random.Random(seed * 1_000_003 + step)
    rows = []
    for _ in range(n):
        a, b = _operands(rng, digits)
        rows.append({"messages": demonstration(a, b, demonstration_kind(rng, flawed), rng)})
    return rows
