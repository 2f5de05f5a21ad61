"""Turns appended through the chat template: for each format, the first prompt, the generated ids and the appended
ids of every turn are exactly the ids of the whole conversation rendered by the template itself."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from rlcore.chat.templates import ChatTemplateError, appended_ids, prompt_ids
from rlcore.models.tokenizer import build_tiny_tokenizer
from rlcore.run.prompts import PASSTHROUGH_TEMPLATE
from tests.chat.tokenizers import llama3_style_tokenizer, qwen_style_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOL_RESULTS = [
    {"role": "tool", "content": "sunny, 21C", "tool_call_id": "call_1", "name": "get_weather"},
    {"role": "tool", "content": "rain tomorrow", "tool_call_id": "call_2", "name": "get_weather"},
]
FIRST = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Weather in Paris?"}]
TURNS: list[tuple[str, list[dict[str, Any]]]] = [
    (f"Let me look.\n{CALL}", TOOL_RESULTS),
    ("Sunny today, rain tomorrow.", [{"role": "user", "content": "And in Rome?"}]),
]
#: What each format appends after the first generated turn (ended by its EOS), written out by hand.
AFTER_TOOL_TURN = {
    "tiny": "\n<|tool|>\nsunny, 21C</s>\n<|tool|>\nrain tomorrow</s>\n<|assistant|>\n",
    "qwen": "\n<|im_start|>user\n<tool_response>\nsunny, 21C\n</tool_response>\n<tool_response>\nrain tomorrow\n"
    "</tool_response><|im_end|>\n<|im_start|>assistant\n",
    "llama3": "<|start_header_id|>tool<|end_header_id|>\n\nsunny, 21C<|eot_id|><|start_header_id|>tool"
    "<|end_header_id|>\n\nrain tomorrow<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
}
TOKENIZERS: dict[str, Callable[[], Any]] = {
    "tiny": build_tiny_tokenizer,
    "qwen": qwen_style_tokenizer,
    "llama3": llama3_style_tokenizer,
}


def generated(tokenizer: Any, text: str, ended: bool = True) -> list[int]:
    """What an engine returns for a completion ``text``: its ids, then the EOS it stopped on."""
    return tokenizer.encode(text, add_special_tokens=False) + ([tokenizer.eos_token_id] if ended else [])


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_prompt_generated_and_appended_ids_are_the_whole_conversation_as_the_template_renders_it(name: str) -> None:
    tokenizer = TOKENIZERS[name]()
    tools = TOOLS if name == "qwen" else None
    sequence = prompt_ids(tokenizer, FIRST, tools=tools)
    conversation = [*FIRST]
    for text, observation in TURNS:
        completion = generated(tokenizer, text)
        sequence += completion + appended_ids(tokenizer, observation, tools=tools, completion_ids=completion)
        conversation += [{"role": "assistant", "content": text}, *observation]
    assert sequence == prompt_ids(tokenizer, conversation, tools=tools)
    first_turn = generated(tokenizer, TURNS[0][0])
    appended = appended_ids(tokenizer, TOOL_RESULTS, tools=tools, completion_ids=first_turn)
    assert tokenizer.decode(appended, skip_special_tokens=False) == AFTER_TOOL_TURN[name]
    assert appended_ids(tokenizer, TOOL_RESULTS, tools=tools) == appended  # without completion_ids: ended by EOS
    if name == "qwen":  # the tools reach the template: listed in the system turn
        assert '"name": "get_weather"' in tokenizer.decode(prompt_ids(tokenizer, FIRST, tools=TOOLS))
        assert prompt_ids(tokenizer, FIRST) != prompt_ids(tokenizer, FIRST, tools=TOOLS)


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_a_completion_cut_before_its_eos_gets_the_templates_closing_appended(name: str) -> None:
    tokenizer = TOKENIZERS[name]()
    text, observation = TURNS[1]
    cut = generated(tokenizer, text, ended=False)  # stopped by max_new_tokens: no EOS generated
    appended = appended_ids(tokenizer, observation, completion_ids=cut)
    assert appended[: len(appended_ids(tokenizer, observation))] != appended_ids(tokenizer, observation)
    conversation = [*FIRST, {"role": "assistant", "content": text}, *observation]
    assert prompt_ids(tokenizer, FIRST) + cut + appended == prompt_ids(tokenizer, conversation)


def test_a_passthrough_template_appends_the_contents_as_they_are() -> None:
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = PASSTHROUGH_TEMPLATE
    completion = generated(tokenizer, "4")
    ids = appended_ids(tokenizer, [{"role": "user", "content": "Again: 2+3?"}], completion_ids=completion)
    assert ids == tokenizer.encode("Again: 2+3?", add_special_tokens=False)


def test_a_template_that_rewrites_earlier_turns_is_refused_naming_the_setting() -> None:
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = "{{ messages | length }} turns: {% for m in messages %}{{ m['content'] }};{% endfor %}"
    with pytest.raises(ChatTemplateError, match=r"renders earlier turns differently.*policy\.tokenizer\.chat_template"):
        appended_ids(tokenizer, [{"role": "user", "content": "more"}])
