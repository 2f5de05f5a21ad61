"""The Hermes tool-call parser against hand-written completions, and parsers added by a plugin's hook."""

from __future__ import annotations

import json

import pytest

from rlcore.chat.tool_calls import ParsedToolCalls, ToolCall, ToolCallParser, get_tool_call_parser
from rlcore.plugins import Registry, hookimpl
from rlcore.plugins.registry import BackendError
from rlcore.plugins.tool_call_parser_spec import ToolCallParserSpec


def builtin_registry() -> Registry:
    """A registry holding rlcore's own parsers, registered as the installed entry point ``chat`` registers them."""
    import rlcore.chat.plugin

    registry = Registry()
    registry.register_plugin(rlcore.chat.plugin, name="rlcore:chat", distribution="rlcore")
    return registry


@pytest.fixture
def hermes() -> ToolCallParser:
    return get_tool_call_parser("hermes", builtin_registry())


def block(obj: object) -> str:
    return f"<tool_call>\n{json.dumps(obj)}\n</tool_call>"


def test_well_formed_calls_in_order_with_the_text_outside_them_as_content(hermes: ToolCallParser) -> None:
    text = (
        "I'll look both up.\n"
        + block({"name": "get_weather", "arguments": {"city": "Paris", "days": 2}})
        + "\n"
        + block({"name": "clock", "arguments": {}})
    )
    parsed = hermes.parse(text)
    assert parsed.content == "I'll look both up."
    assert [(c.name, c.arguments) for c in parsed.calls] == [
        ("get_weather", {"city": "Paris", "days": 2}),
        ("clock", {}),
    ]
    assert parsed.invalid == []
    ids = [c.id for c in parsed.calls]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)
    assert [c.id for c in hermes.parse(text).calls] == ids  # the same completion gets the same ids


def test_plain_text_has_no_calls(hermes: ToolCallParser) -> None:
    assert hermes.parse("  The answer is 4.  ") == ParsedToolCalls(content="The answer is 4.", calls=[], invalid=[])


def test_a_call_without_arguments_calls_with_none(hermes: ToolCallParser) -> None:
    assert [(c.name, c.arguments) for c in hermes.parse(block({"name": "clock"})).calls] == [("clock", {})]


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ('{"name": "f", "arguments": {"x": 1}', "not valid JSON"),
        ('["f", {"x": 1}]', "expected a JSON object"),
        ('{"arguments": {"x": 1}}', "missing 'name'"),
        ('{"name": "", "arguments": {}}', "missing 'name'"),
        ('{"name": "f", "arguments": [1, 2]}', "'arguments' of 'f' must be a JSON object, got list"),
        ('{"name": "f", "arguments": "{\\"x\\": 1}"}', "must be a JSON object, got str"),
    ],
)
def test_a_malformed_call_is_invalid_with_its_reason_and_the_good_ones_still_parse(
    hermes: ToolCallParser, body: str, reason: str
) -> None:
    text = "before <tool_call>" + body + "</tool_call> between " + block({"name": "ok", "arguments": {"a": 1}})
    parsed = hermes.parse(text)
    assert [c.name for c in parsed.calls] == ["ok"]
    assert len(parsed.invalid) == 1 and parsed.invalid[0].startswith("call 0: ") and reason in parsed.invalid[0]
    assert parsed.content == "before  between"


def test_unclosed_and_unopened_tags_are_invalid(hermes: ToolCallParser) -> None:
    parsed = hermes.parse('text <tool_call>{"name": "f", "arguments": {}}')  # cut by max tokens
    assert parsed.calls == [] and parsed.content == "text"
    assert parsed.invalid == ["call 0: '<tool_call>' is never closed with '</tool_call>'"]
    parsed = hermes.parse("<tool_call>{} " + block({"name": "g", "arguments": {}}))  # the first never closed
    assert [c.name for c in parsed.calls] == ["g"] and "never closed" in parsed.invalid[0]
    parsed = hermes.parse("oops</tool_call> done")
    assert parsed.calls == [] and parsed.content == "oops done" and "without an opening" in parsed.invalid[0]


class UpperParser:
    """A plugin's parser: each line 'CALL name' is a call without arguments."""

    def parse(self, text: str) -> ParsedToolCalls:
        calls = [ToolCall(line[5:], {}, f"c{i}") for i, line in enumerate(text.splitlines()) if line[:5] == "CALL "]
        rest = "\n".join(line for line in text.splitlines() if line[:5] != "CALL ")
        return ParsedToolCalls(content=rest, calls=calls, invalid=[])


class ParserPlugin:
    @hookimpl
    def rlcore_register_tool_call_parsers(self, register):  # type: ignore[no-untyped-def]
        register(ToolCallParserSpec(name="upper", parser_class=f"{__name__}:UpperParser"))
        register(ToolCallParserSpec(name="Bad name!", parser_class="x:Y"))  # refused on its own


def test_a_plugin_adds_a_parser_through_the_hook_beside_the_builtin_one() -> None:
    registry = builtin_registry()
    registry.register_plugin(ParserPlugin(), name="rl-upper:parsers", distribution="rl-upper")
    parsed = get_tool_call_parser("upper", registry).parse("hi\nCALL ping")
    assert parsed.calls == [ToolCall("ping", {}, "c1")] and parsed.content == "hi"
    assert get_tool_call_parser("rl-upper:upper", registry).parse("CALL x").calls[0].name == "x"
    assert isinstance(get_tool_call_parser("hermes", registry), ToolCallParser)
    rows = {(r.name, r.distribution, r.status) for r in registry.tool_call_parsers()}
    assert ("upper", "rl-upper", "ok") in rows and ("hermes", "rlcore", "ok") in rows
    assert ("Bad name!", "rl-upper", "broken") in rows
    assert registry.backends() == [] and registry.environments() == []  # parsers are a kind of their own


def test_an_unknown_parser_is_refused_naming_the_installed_ones_and_the_hook() -> None:
    with pytest.raises(
        BackendError,
        match=r"no tool-call parser named 'qwen3'.*installed: hermes.*"
        r"rlcore_register_tool_call_parsers",
    ):
        get_tool_call_parser("qwen3", builtin_registry())
