"""Registers rlcore's own tool-call parsers through the public hook, as a third party would (light: only names)."""

from collections.abc import Callable

from rlcore.plugins import hookimpl
from rlcore.plugins.tool_call_parser_spec import ToolCallParserSpec


@hookimpl
def rlcore_register_tool_call_parsers(register: Callable[[ToolCallParserSpec], None]) -> None:
    register(
        ToolCallParserSpec(
            name="hermes",
            parser_class="rlcore.chat.hermes:HermesToolCallParser",
            description='Hermes / Qwen2.5 calls: <tool_call>{"name": ..., "arguments": {...}}</tool_call>.',
        )
    )
