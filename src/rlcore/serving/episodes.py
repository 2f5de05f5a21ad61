"""Tokens in, tokens out, per rollout id: what each episode's requests sent the engine and what it generated.

rlcore trains one token sequence per episode, so every request of an episode must continue the sequence the
previous one ended with. A chat request continues it when its ``messages`` are the previous request's messages,
then the assistant message the server returned for it, then new messages (user, tool or system ones): its prompt is
then the previous prompt ids + the generated ids + the chat template's rendering of the new messages alone
(:func:`rlcore.chat.templates.appended_ids`). The history is never rendered again, so the tokens the trainer sees
are the ones the engine saw and sampled, whatever the template would make of the text.

A request that does not continue its episode (an edited, dropped or reordered message, a changed tool list, an
assistant message the policy did not write) fails the episode: it is answered with an error naming what differs,
and so is every later request of that rollout id. The sample then counts as an environment error (reward 0, counted
in ``env/errors``), like a sample an environment cannot score. A completions request (token ids or text) continues
an episode when its prompt ids start with the previous prompt ids + generated ids.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: One chat message as a request carries it (tool messages: ``tool_call_id``; assistant ones: ``tool_calls``).
Message = dict[str, Any]


class EpisodeError(Exception):
    """A request that does not continue its episode's token sequence; the episode has failed."""


@dataclass
class Turn:
    """One served request of an episode: the prompt ids sent to the engine and what came back.

    ``logprobs``: the engine's logprob of each generated token. ``token_versions``: the weight version of each
    generated token (an engine that reports them), else None. ``truncated``: cut by ``max_tokens``, the engine's
    ``max_new_tokens`` or the sequence budget. ``invalid_tool_calls``: the completion held a malformed tool call.
    """

    prompt_ids: list[int]
    generated_ids: list[int]
    logprobs: list[float]
    weight_version: int | None = None
    token_versions: list[int] | None = None
    window: tuple[float, float] | None = None
    truncated: bool = False
    tool_calls: int = 0
    invalid_tool_calls: bool = False

    @property
    def sequence(self) -> list[int]:
        """The episode's token sequence after this turn."""
        return [*self.prompt_ids, *self.generated_ids]


@dataclass
class Episode:
    """One rollout id's turns. ``seed_of(turn)``: the sampling seed of the episode's ``turn``-th request (None: the
    engine's own randomness). ``greedy``: its requests are decoded greedily (validation)."""

    rollout_id: str
    seed_of: Callable[[int], int] | None = None
    greedy: bool = False
    turns: list[Turn] = field(default_factory=list)
    error: str | None = None
    out_of_room: bool = False  # a request found no room left within the sequence budget
    chat_messages: list[Message] | None = None  # the last chat request's messages (None: none yet, or completions)
    reply: Message | None = None  # the assistant message returned for it
    tools: list[dict[str, Any]] | None = None  # the first chat request's tools (rendered into its prompt)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def fail(self, reason: str) -> EpisodeError:
        """Mark the episode failed with ``reason`` (the first reason stays) and return the error to raise."""
        if self.error is None:
            self.error = f"rollout {self.rollout_id}: {reason}"
        return EpisodeError(self.error)

    def check_open(self) -> None:
        if self.error is not None:
            raise EpisodeError(f"{self.error} (the episode failed at an earlier request)")

    def chat_prompt(
        self,
        tokenizer: Any,
        messages: list[Message],
        tools: list[dict[str, Any]] | None,
        chat_template_kwargs: dict[str, Any] | None,
    ) -> list[int]:
        """The prompt ids of a chat request of this episode (see the module doc); raises :class:`EpisodeError`."""
        from rlcore.chat import templates

        self.check_open()
        if not self.turns:
            return list(
                templates.prompt_ids(tokenizer, messages, tools=tools, chat_template_kwargs=chat_template_kwargs)
            )
        new = self.new_messages(messages, tools)
        last = self.turns[-1]
        appended = templates.appended_ids(
            tokenizer, new, tools=tools, chat_template_kwargs=chat_template_kwargs, completion_ids=last.generated_ids
        )
        return [*last.sequence, *appended]

    def new_messages(self, messages: list[Message], tools: list[dict[str, Any]] | None) -> list[Message]:
        """The messages of a chat request after the previous request's messages and the reply; raises
        :class:`EpisodeError` when the request does not extend them."""
        if self.chat_messages is None or self.reply is None:
            raise self.fail("a chat request followed a completions request; an episode uses one API throughout")
        if _normalized_tools(tools) != _normalized_tools(self.tools):
            raise self.fail(
                "the request's tools differ from the first request's (the first prompt rendered them; rlcore "
                "trains one token sequence per episode, so the tools stay as they were)"
            )
        previous = [*self.chat_messages, self.reply]
        if len(messages) < len(previous):
            raise self.fail(
                f"the request has {len(messages)} messages, fewer than the previous request's {len(previous) - 1} "
                "plus the assistant reply: a request must repeat the conversation so far and add to it"
            )
        for index, (sent, before) in enumerate(zip(messages, previous)):
            if normalized(sent) != normalized(before):
                what = (
                    "the assistant reply the server returned" if index == len(previous) - 1 else "the one sent before"
                )
                raise self.fail(
                    f"message {index} ({sent.get('role')!r}) differs from {what}: the history was rewritten, and "
                    "rlcore trains one token sequence per episode (send the conversation so far unchanged, then "
                    "the new messages)"
                )
        new = messages[len(previous) :]
        if any(m.get("role") == "assistant" for m in new):
            raise self.fail(
                "a new message has the role 'assistant': the policy did not generate it (only user, tool and "
                "system messages may follow the reply)"
            )
        return new

    def completion_prompt(self, ids: list[int]) -> list[int]:
        """The prompt ids of a completions request: they must start with the episode's sequence so far."""
        self.check_open()
        if self.turns and self.chat_messages is not None:
            raise self.fail("a completions request followed a chat request; an episode uses one API throughout")
        if self.turns:
            sequence = self.turns[-1].sequence
            if ids[: len(sequence)] != sequence:
                raise self.fail(
                    "the prompt does not start with the previous prompt and its completion (token ids): rlcore "
                    "trains one token sequence per episode"
                )
        return ids

    def record(
        self,
        turn: Turn,
        messages: list[Message] | None = None,
        reply: Message | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> None:
        """Add a served turn (with a chat request's messages, its tools and the reply the server returned)."""
        if not self.turns:
            self.tools = tools
        self.turns.append(turn)
        self.chat_messages = [dict(m) for m in messages] if messages is not None else None
        self.reply = dict(reply) if reply is not None else None

    def next_seed(self) -> int | None:
        return self.seed_of(len(self.turns)) if self.seed_of is not None else None


class EpisodeBook:
    """The episodes of the rollouts being served, by rollout id (thread-safe)."""

    def __init__(self) -> None:
        self._episodes: dict[str, Episode] = {}
        self._lock = threading.Lock()

    def open(self, rollout_id: str, seed_of: Callable[[int], int] | None = None, greedy: bool = False) -> Episode:
        with self._lock:
            if rollout_id in self._episodes:
                raise ValueError(f"rollout id {rollout_id!r} is already open")
            episode = self._episodes[rollout_id] = Episode(rollout_id, seed_of, greedy)
            return episode

    def get(self, rollout_id: str) -> Episode | None:
        with self._lock:
            return self._episodes.get(rollout_id)

    def close(self, rollout_id: str) -> Episode:
        """Remove and return the episode; it waits for a request of it still being served."""
        with self._lock:
            episode = self._episodes.pop(rollout_id)
        with episode.lock:
            return episode


def message_text(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a list of content parts (None: empty)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text")
    return str(content)


def normalized(message: Message) -> dict[str, Any]:
    """What makes two messages the same turn: role, text, tool calls (name and arguments as JSON values), and a
    tool message's ``tool_call_id`` / ``name``. Fields a client adds or drops (``refusal: null``, ...) do not count."""
    out: dict[str, Any] = {"role": message.get("role"), "content": message_text(message.get("content"))}
    calls = message.get("tool_calls")
    if calls:
        out["tool_calls"] = [_normalized_call(call) for call in calls]
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            out[key] = message[key]
    return out


def _normalized_call(call: Any) -> tuple[Any, Any, Any]:
    function = call.get("function", {}) if isinstance(call, dict) else {}
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    return call.get("id") if isinstance(call, dict) else None, function.get("name"), arguments


def _normalized_tools(tools: list[dict[str, Any]] | None) -> str:
    return json.dumps(tools or [], sort_keys=True)


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as chat templates take it: text content, and tool-call arguments as a mapping."""
    out = dict(message)
    out["content"] = message_text(message.get("content"))
    calls = message.get("tool_calls")
    if calls:
        fixed = []
        for call in calls:
            call = dict(call)
            function = dict(call.get("function") or {})
            if isinstance(function.get("arguments"), str):
                with contextlib.suppress(ValueError):
                    function["arguments"] = json.loads(function["arguments"])
            call["function"] = function
            fixed.append(call)
        out["tool_calls"] = fixed
    return out
