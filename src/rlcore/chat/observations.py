"""An environment's observation as the token ids appended to a trajectory, and the messages its log keeps.

- ``role: environment`` (and any role that is not a chat role): the content tokenized as is, no special tokens,
  NeMo-RL's way (an environment that talks to a chat model writes its template's turn markers into the content).
- A chat role (``user``, ``tool``, ``system``): the message through the chat template after the assistant turn
  just generated (:func:`rlcore.chat.templates.appended_ids`), generation prompt included.
- ``messages`` (a list of chat messages, e.g. one ``tool`` message per call): those messages through the template,
  in order; the observation's own ``role`` and ``content`` are then not rendered.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: The roles an observation is rendered through the chat template with.
CHAT_ROLES = frozenset({"user", "tool", "system"})


@dataclass(frozen=True)
class ChatContext:
    """What the chat template needs beyond the messages: the environment's tools and the template's kwargs."""

    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def observation_messages(observation: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The chat messages an observation carries (its ``messages``, or itself with a chat role); None for a raw
    observation (``role: environment``)."""
    messages = observation.get("messages")
    if messages is not None:
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError(
                "an observation's 'messages' must be a list of chat messages, each a dict with a 'role' "
                f"(got {messages!r:.200})"
            )
        return [dict(m) for m in messages]
    if observation.get("role") in CHAT_ROLES:
        return [dict(observation)]
    return None


def observation_ids(
    tokenizer: Any, observation: dict[str, Any], completion_ids: Sequence[int], chat: ChatContext | None = None
) -> tuple[list[int], list[dict[str, Any]]]:
    """``(ids, logged)``: the ids appended after a completion (``completion_ids``, as generated) for
    ``observation``, and the messages the sample's log gains."""
    from rlcore.chat.templates import appended_ids

    messages = observation_messages(observation)
    if messages is None:
        return tokenizer.encode(observation.get("content", ""), add_special_tokens=False), [dict(observation)]
    chat = chat or ChatContext()
    ids = appended_ids(
        tokenizer,
        messages,
        tools=chat.tools,
        chat_template_kwargs=chat.chat_template_kwargs,
        completion_ids=completion_ids,
    )
    return ids, messages


__all__ = ["CHAT_ROLES", "ChatContext", "observation_ids", "observation_messages"]
