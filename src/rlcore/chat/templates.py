"""Chat turns as token ids: the first prompt, and what is appended after a generated assistant turn.

A multi-turn rollout trains on exactly the ids the engine generated. The next turn is not re-rendered from the
decoded conversation (a template that trims content, or a BPE merge across a boundary, would change the ids the
policy scores); only the new messages (tool results, a user's reply) are rendered and appended.

:func:`appended_ids` renders them against a fixed stand-in conversation, ``user`` then ``assistant`` with
placeholder contents: the template's render of the stand-in plus the new messages (with the generation prompt),
less its render of the stand-in alone, is what the template writes between an assistant turn and the next
generation. The render of the stand-in must be a prefix of the longer one; a template that rewrites earlier turns
when later ones are added is refused, naming why.

What the generated ids already hold: the template closes an assistant turn with some text after its content
(ChatML's ``<|im_end|>\\n``, Llama 3's ``<|eot_id|>``). The engine stops on the end token and keeps it, so a
completion that ended with the tokenizer's EOS has generated the closing up to and including that token; the
rest (ChatML's ``\\n``) is appended. A completion that did not end with it (cut by ``max_new_tokens``, or at a
stop string) has not closed its turn: the whole closing is appended, so the next turn still reads as the
template's (pass ``completion_ids`` to say which case it is; without it the completion is taken to have ended
with the EOS).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: The stand-in turns the new messages are rendered after; the contents are placeholders no template changes.
STAND_IN_USER = "rlcore-stand-in-user-turn"
STAND_IN_ASSISTANT = "rlcore-stand-in-assistant-turn"


class ChatTemplateError(ValueError):
    """The chat template cannot render turns one at a time (the message says why and what to do)."""


def prompt_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The ids of a first prompt: ``messages`` through the chat template (with ``tools``) and the generation
    prompt, encoded as rollouts encode prompts (:func:`encode_rendered`)."""
    return encode_rendered(tokenizer, render(tokenizer, messages, True, tools, chat_template_kwargs))


def encode_rendered(tokenizer: Any, text: str) -> list[int]:
    """The token ids of a rendered prompt, starting with the tokenizer's BOS (once: a chat template may have
    written it)."""
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    bos = tokenizer.bos_token_id
    return ids if bos is None or ids[:1] == [bos] else [bos, *ids]


def appended_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    completion_ids: Sequence[int] | None = None,
) -> list[int]:
    """The ids to append after a generated assistant completion so that the next generation continues as the
    chat template renders ``messages`` (new ``user`` / ``tool`` / ``system`` messages) and the generation prompt.

    ``completion_ids``: the completion as generated; when its last id is not the tokenizer's EOS (it was cut),
    the template's closing of the assistant turn is appended first (module docstring). Earlier turns are never
    rendered again."""
    return tokenizer.encode(
        appended_text(tokenizer, messages, tools, chat_template_kwargs, completion_ids), add_special_tokens=False
    )


def appended_text(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    completion_ids: Sequence[int] | None = None,
) -> str:
    """The text :func:`appended_ids` encodes: the rest of the assistant turn's closing, the new messages and the
    generation prompt."""
    stand_in: list[dict[str, Any]] = [
        {"role": "user", "content": STAND_IN_USER},
        {"role": "assistant", "content": STAND_IN_ASSISTANT},
    ]
    before = render(tokenizer, stand_in, False, tools, chat_template_kwargs)
    after = render(tokenizer, [*stand_in, *messages], True, tools, chat_template_kwargs)
    if not after.startswith(before):
        at = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
        raise ChatTemplateError(
            "the chat template renders earlier turns differently once later messages are added (at char "
            f"{at}: {before[max(0, at - 30) : at + 30]!r} becomes {after[max(0, at - 30) : at + 30]!r}), so turns "
            "cannot be appended without re-encoding the conversation: use a template whose render of a "
            "conversation is a prefix of its render with more messages (policy.tokenizer.chat_template)"
        )
    if STAND_IN_ASSISTANT not in before:
        raise ChatTemplateError(
            "the chat template does not render an assistant message's content as given, so where an assistant "
            "turn ends cannot be told: use a template that writes assistant content (policy.tokenizer.chat_template)"
        )
    closing = before[before.rindex(STAND_IN_ASSISTANT) + len(STAND_IN_ASSISTANT) :]
    return rest_of_closing(tokenizer, closing, completion_ids) + after[len(before) :]


def rest_of_closing(tokenizer: Any, closing: str, completion_ids: Sequence[int] | None) -> str:
    """What of the template's assistant ``closing`` the completion has not generated: after the EOS when the
    completion ended with it (or ``completion_ids`` is None), else all of it."""
    eos, eos_id = getattr(tokenizer, "eos_token", None), getattr(tokenizer, "eos_token_id", None)
    ended = completion_ids is None or (len(completion_ids) > 0 and completion_ids[-1] == eos_id)
    if ended and eos and eos in closing:
        return closing[closing.index(eos) + len(eos) :]
    return closing  # cut before its end, or a template that writes no EOS (the generated one closes nothing)


def render(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> str:
    """``messages`` through the tokenizer's chat template, as text (``tools`` passed only when given, so a
    tokenizer stand-in without the argument works)."""
    kwargs = dict(chat_template_kwargs or {})
    if tools is not None:
        kwargs["tools"] = tools
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )
    assert isinstance(text, str)
    return text


__all__ = ["ChatTemplateError", "appended_ids", "appended_text", "encode_rendered", "prompt_ids", "render"]
