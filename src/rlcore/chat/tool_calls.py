"""Tool calls in an assistant completion: what a parser returns, the parser protocol, and selecting one by name.

Parsers are plugins: a plugin declares one with ``ToolCallParserSpec`` from the ``rlcore_register_tool_call_parsers``
hook; rlcore's own (``hermes``) is registered through the same hook by :mod:`rlcore.chat.plugin`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from rlcore.plugins.registry import Registry


@dataclass(frozen=True)
class ToolCall:
    """One well-formed call: the function's name, its arguments (a JSON object) and the call's id."""

    name: str
    arguments: dict[str, Any]
    id: str


@dataclass(frozen=True)
class ParsedToolCalls:
    """A completion split into its text outside the calls (``content``), its well-formed ``calls``, in order, and
    one reason per malformed call (``invalid``)."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    invalid: list[str] = field(default_factory=list)


@runtime_checkable
class ToolCallParser(Protocol):
    """Finds the tool calls in an assistant completion's text. Built with no arguments."""

    def parse(self, text: str) -> ParsedToolCalls: ...


def get_tool_call_parser(name: str, registry: Registry | None = None) -> ToolCallParser:
    """A new parser registered as ``name`` (or ``distribution:name``), from ``registry`` (the process-wide one
    when None; rlcore registers its own through the public hook, entry point ``chat``)."""
    from rlcore.plugins.registry import BackendError, get_registry

    registry = registry if registry is not None else get_registry()
    short = name.rpartition(":")[2]
    known = sorted({r.name for r in registry.tool_call_parsers() if r.spec is not None})
    if short not in known:
        raise BackendError(
            f"no tool-call parser named '{name}' (installed: {', '.join(known) or 'none'}); a plugin adds one "
            "with a ToolCallParserSpec from its rlcore_register_tool_call_parsers hook (docs/multi-turn.md)"
        )
    spec = registry.resolve_tool_call_parser(name)
    parser = spec.load_parser_class()()
    if not isinstance(parser, ToolCallParser):
        raise TypeError(f"tool-call parser '{name}': {spec.parser_class} has no parse(text) method")
    return parser


__all__ = ["ParsedToolCalls", "ToolCall", "ToolCallParser", "get_tool_call_parser"]
