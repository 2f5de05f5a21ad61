"""Tokenizers with the chat formats of real model families, built locally on the tiny byte-level vocabulary.

Each adds its format's special tokens (one id each, as in the real tokenizers) to
:func:`rlcore.models.tokenizer.build_tiny_tokenizer` and installs a template written here in that family's format:
ChatML with tools as Qwen2.5 renders it (tools listed in the system turn, calls in ``<tool_call>`` tags, tool
results grouped in one user turn of ``<tool_response>`` blocks), and Llama 3's headers with trimmed contents.
"""

from __future__ import annotations

from typing import Any

#: ChatML with tools in Qwen2.5's layout. Jinja string literals carry the newlines (HF renders with trim_blocks).
QWEN_STYLE_TEMPLATE = (
    r"{%- if tools -%}"
    r"{{- '<|im_start|>system\n' -}}"
    r"{{- messages[0].content if messages[0].role == 'system' else 'You are a helpful assistant.' -}}"
    r"{{- '\n\n# Tools\n\nYou may call one or more functions.\n<tools>' -}}"
    r"{%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}"
    r"{{- '\n</tools>\n\nReturn each call as <tool_call>\n{\"name\": <name>, \"arguments\": <object>}\n"
    r"</tool_call><|im_end|>\n' -}}"
    r"{%- elif messages[0].role != 'system' -%}"
    r"{{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' -}}"
    r"{%- endif -%}"
    r"{%- for message in messages -%}"
    r"{%- if message.role == 'system' -%}"
    r"{%- if not (loop.first and tools) -%}"
    r"{{- '<|im_start|>system\n' + message.content + '<|im_end|>\n' -}}"
    r"{%- endif -%}"
    r"{%- elif message.role == 'user' -%}"
    r"{{- '<|im_start|>user\n' + message.content + '<|im_end|>\n' -}}"
    r"{%- elif message.role == 'assistant' -%}"
    r"{{- '<|im_start|>assistant' -}}"
    r"{%- if message.content -%}{{- '\n' + message.content -}}{%- endif -%}"
    r"{%- for call in message.tool_calls or [] -%}"
    r"{%- set f = call.function if call.function is defined else call -%}"
    r"{{- '\n<tool_call>\n{\"name\": \"' + f.name + '\", \"arguments\": ' -}}"
    r"{{- (f.arguments | tojson) + '}\n</tool_call>' -}}"
    r"{%- endfor -%}"
    r"{{- '<|im_end|>\n' -}}"
    r"{%- elif message.role == 'tool' -%}"
    r"{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    r"{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' -}}"
    r"{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}"
    r"{%- endif -%}"
    r"{%- endfor -%}"
    r"{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)

#: Llama 3's format: BOS once, a header per message, contents trimmed, each turn closed by <|eot_id|>.
LLAMA3_STYLE_TEMPLATE = (
    r"{{- bos_token -}}"
    r"{%- for message in messages -%}"
    r"{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + (message.content | trim) + '<|eot_id|>' -}}"
    r"{%- endfor -%}"
    r"{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}{%- endif -%}"
)


def _with_specials(specials: list[str], bos: str | None, eos: str, template: str) -> Any:
    from rlcore.models.tokenizer import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.bos_token = bos
    tokenizer.eos_token = eos
    tokenizer.chat_template = template
    return tokenizer


def qwen_style_tokenizer() -> Any:
    """ChatML specials (``<|im_start|>``, ``<|im_end|>`` the EOS, ``<|endoftext|>``), no BOS, Qwen2.5's layout."""
    return _with_specials(["<|im_start|>", "<|im_end|>", "<|endoftext|>"], None, "<|im_end|>", QWEN_STYLE_TEMPLATE)


def llama3_style_tokenizer() -> Any:
    """Llama 3's specials (``<|begin_of_text|>`` the BOS, ``<|eot_id|>`` the EOS, headers), contents trimmed."""
    specials = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    return _with_specials(specials, "<|begin_of_text|>", "<|eot_id|>", LLAMA3_STYLE_TEMPLATE)
