"""The Hermes / Qwen2.5 tool-call format: each call is a JSON object between ``<tool_call>`` and ``</tool_call>``.

``<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>``, as Qwen2.5's chat
template renders an assistant's ``tool_calls`` (and as Qwen2.5 and Hermes models write them). ``content`` is the
text outside the tags, stripped of surrounding whitespace. A call whose JSON does not parse, that is not an
object, has no string ``name`` or whose ``arguments`` is not an object (a JSON string holding an object is refused
too: the template never renders one) is invalid, with the reason; so is an opening tag never closed (everything
after it is that call) and a closing tag never opened. A call without ``arguments`` calls with none (``{}``).
"""

from __future__ import annotations

import hashlib
import json
import re

from rlcore.chat.tool_calls import ParsedToolCalls, ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_TAG = re.compile(re.escape(OPEN) + "|" + re.escape(CLOSE))


def call_id(index: int, body: str) -> str:
    """A call id, the same for the same call at the same place (so a rollout replays the same ids)."""
    return "call_" + hashlib.sha256(f"{index}\0{body}".encode()).hexdigest()[:24]


class HermesToolCallParser:
    """Parses Hermes-style ``<tool_call>`` blocks."""

    def parse(self, text: str) -> ParsedToolCalls:
        content: list[str] = []
        calls: list[ToolCall] = []
        invalid: list[str] = []
        position = 0
        index = 0
        while (tag := _TAG.search(text, position)) is not None:
            content.append(text[position : tag.start()])
            if tag.group() == CLOSE:
                invalid.append(f"call {index}: '{CLOSE}' without an opening '{OPEN}'")
                index += 1
                position = tag.end()
                continue
            end = text.find(CLOSE, tag.end())
            following_open = text.find(OPEN, tag.end())
            if end < 0 or (0 <= following_open < end):
                stop = following_open if following_open >= 0 else len(text)
                invalid.append(f"call {index}: '{OPEN}' is never closed with '{CLOSE}'")
                index += 1
                position = stop
                continue
            body = text[tag.end() : end]
            call, reason = _call(index, body)
            if call is not None:
                calls.append(call)
            else:
                invalid.append(f"call {index}: {reason}")
            index += 1
            position = end + len(CLOSE)
        content.append(text[position:])
        return ParsedToolCalls(content="".join(content).strip(), calls=calls, invalid=invalid)


def _call(index: int, body: str) -> tuple[ToolCall | None, str]:
    """The call in one block's body, or None and why it is malformed."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError as exc:
        return None, f"not valid JSON ({exc.msg} at char {exc.pos})"
    if not isinstance(data, dict):
        return None, f"expected a JSON object with 'name' and 'arguments', got {type(data).__name__}"
    name = data.get("name")
    if not isinstance(name, str) or not name:
        return None, "missing 'name' (a non-empty string)"
    arguments = data.get("arguments", {})
    if not isinstance(arguments, dict):
        return None, f"'arguments' of '{name}' must be a JSON object, got {type(arguments).__name__}"
    return ToolCall(name=name, arguments=arguments, id=call_id(index, body.strip())), ""
