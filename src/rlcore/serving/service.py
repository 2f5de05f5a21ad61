"""What one request to the endpoint does, without the HTTP: check it, encode its prompt (within its episode, if it
has a rollout id), generate one sample with the engine, parse the tool calls, record the turn, answer.

Each request is one single-sample ``generate_async`` request to a backend that serves continuously, so requests
from many episodes share the engines' running batch. The requests of one rollout id are served one at a time.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any

from rlcore.serving.episodes import Episode, EpisodeBook, EpisodeError, Turn, template_message
from rlcore.serving.openai_api import (
    ApiError,
    Sampling,
    chat_request,
    chat_response,
    completion_request,
    completion_response,
    models_response,
    token_logprobs,
)


@dataclass(frozen=True)
class ServingSettings:
    """What the endpoint serves with: the run's sampling (:class:`Sampling`), its sequence budget
    (``policy.max_total_sequence_length``), padding id, chat template arguments and tool-call parser."""

    sampling: Sampling
    max_total: int
    pad_id: int
    chat_template_kwargs: dict[str, Any] | None = None
    tool_call_parser: str = "hermes"

    @classmethod
    def from_config(cls, cfg: Any, pad_id: int) -> ServingSettings:
        """The settings of run config ``cfg`` (a ``RLCoreConfig``)."""
        policy = cfg.policy
        generation = policy.generation
        return cls(
            sampling=Sampling(
                model=generation.model_name or policy.model_name,
                temperature=generation.temperature,
                top_p=generation.top_p,
                top_k=generation.top_k,
                max_new_tokens=generation.max_new_tokens,
            ),
            max_total=policy.max_total_sequence_length,
            pad_id=pad_id,
            chat_template_kwargs=policy.tokenizer.chat_template_kwargs,
            tool_call_parser=getattr(generation, "tool_call_parser", "hermes"),
        )


class ChatService:
    """The endpoint's requests over ``generation`` (a backend that serves continuously), by rollout id."""

    def __init__(self, generation: Any, tokenizer: Any, settings: ServingSettings) -> None:
        self.generation, self.tokenizer, self.settings = generation, tokenizer, settings
        self.episodes = EpisodeBook()
        self._parser: Any = None
        self._parser_lock = threading.Lock()  # request threads parse side by side; the parser is made once

    def models(self) -> dict[str, Any]:
        return models_response(self.settings.sampling)

    def tokenize(self, body: Any) -> dict[str, Any]:
        """vLLM's ``/tokenize`` (:mod:`rlcore.serving.tokenize_api`): the ids a prompt or conversation has here."""
        from rlcore.serving import tokenize_api

        settings = self.settings
        return tokenize_api.tokenize(
            body, self.tokenizer, settings.sampling.model, settings.max_total, settings.chat_template_kwargs
        )

    def detokenize(self, body: Any) -> dict[str, Any]:
        """vLLM's ``/detokenize``: the text of token ids."""
        from rlcore.serving import tokenize_api

        return tokenize_api.detokenize(body, self.tokenizer, self.settings.sampling.model)

    def chat(self, rollout_id: str | None, body: Any) -> dict[str, Any]:
        """Answer a ``chat/completions`` request (of rollout ``rollout_id``, or of none)."""
        from rlcore.chat import templates

        episode = self._episode(rollout_id)
        request = chat_request(body, self.settings.sampling, episode is not None and episode.greedy)
        kwargs = self.settings.chat_template_kwargs
        messages = [template_message(m) for m in request.messages]
        with episode.lock if episode is not None else contextlib.nullcontext():
            try:
                if episode is not None:
                    prompt = episode.chat_prompt(self.tokenizer, messages, request.tools, kwargs)
                else:
                    prompt = list(
                        templates.prompt_ids(self.tokenizer, messages, tools=request.tools, chat_template_kwargs=kwargs)
                    )
            except EpisodeError as exc:
                raise ApiError(400, str(exc), "messages") from None
            turn = self._generate(episode, prompt, request.max_tokens, request.stop)
            text = self.tokenizer.decode(turn.generated_ids, skip_special_tokens=True)
            message, finish = self._assistant(text, turn, request.parse_tools)
            if episode is not None:
                episode.record(turn, request.messages, message, request.tools)
        content = token_logprobs(self.tokenizer, turn.generated_ids, turn.logprobs) if request.logprobs else None
        return chat_response(
            self.settings.sampling, message, finish, prompt, turn.generated_ids, turn.logprobs, content,
            turn.weight_version,
        )  # fmt: skip

    def completion(self, rollout_id: str | None, body: Any) -> dict[str, Any]:
        """Answer a ``completions`` request: a text prompt is encoded with the tokenizer's special tokens (as vLLM
        does); token ids are used as they are."""
        episode = self._episode(rollout_id)
        request = completion_request(body, self.settings.sampling, episode is not None and episode.greedy)
        if request.prompt_ids is not None:
            ids = list(request.prompt_ids)
        else:
            ids = list(self.tokenizer(request.prompt_text)["input_ids"])
        with episode.lock if episode is not None else contextlib.nullcontext():
            try:
                prompt = episode.completion_prompt(ids) if episode is not None else ids
            except EpisodeError as exc:
                raise ApiError(400, str(exc), "prompt") from None
            turn = self._generate(episode, prompt, request.max_tokens, request.stop)
            if episode is not None:
                episode.record(turn)
        text = self.tokenizer.decode(turn.generated_ids, skip_special_tokens=True)
        tokens = [self.tokenizer.decode([t]) for t in turn.generated_ids] if request.logprobs else None
        finish = "length" if turn.truncated else "stop"
        return completion_response(
            self.settings.sampling, text, finish, prompt, turn.generated_ids, turn.logprobs, tokens,
            turn.weight_version,
        )  # fmt: skip

    def _episode(self, rollout_id: str | None) -> Episode | None:
        if rollout_id is None:
            return None
        episode = self.episodes.get(rollout_id)
        if episode is None:
            raise ApiError(404, f"no rollout {rollout_id!r} is being served (its episode ended, or never began)")
        return episode

    def _generate(self, episode: Episode | None, prompt: list[int], max_tokens: int, stop: list[str] | None) -> Turn:
        """One single-sample engine request; its completion cut to ``max_tokens`` and to the sequence budget."""
        import torch

        from rlcore.data import BatchedDataDict

        if episode is not None:
            episode.check_open()
        room = self.settings.max_total - len(prompt)
        if room <= 0:
            if episode is not None:
                episode.out_of_room = True
            raise ApiError(
                400,
                f"the conversation is {len(prompt)} tokens long and leaves no room to generate within "
                f"policy.max_total_sequence_length ({self.settings.max_total})",
                "messages",
            )
        batch: BatchedDataDict[Any] = BatchedDataDict(
            input_ids=torch.tensor([prompt], dtype=torch.long), input_lengths=torch.tensor([len(prompt)])
        )
        if stop:
            batch["stop_strings"] = [list(stop)]
        seed = episode.next_seed() if episode is not None else None
        if seed is not None:
            batch["sampling_seeds"] = torch.tensor([seed], dtype=torch.long)
        greedy = episode is not None and episode.greedy
        try:
            out = self.generation.collect(self.generation.generate_async(batch, greedy=greedy))
        except ValueError as exc:  # the backend refused the request before it reached an engine
            raise ApiError(400, str(exc)) from None
        except Exception as exc:
            if episode is not None:
                episode.fail(f"the engine failed: {type(exc).__name__}: {exc}")
            raise ApiError(500, f"the engine failed: {type(exc).__name__}: {exc}", kind="server_error") from None
        return _turn(out, prompt, min(max_tokens, room))

    def _assistant(self, text: str, turn: Turn, parse_tools: bool) -> tuple[dict[str, Any], str]:
        """The reply message (tool calls parsed when the request offered tools) and its ``finish_reason``."""
        import json

        message: dict[str, Any] = {"role": "assistant", "content": text}
        if parse_tools:
            parsed = self._tool_call_parser().parse(text)
            turn.invalid_tool_calls = bool(parsed.invalid)
            turn.tool_calls = len(parsed.calls)
            if parsed.calls:
                message["content"] = parsed.content or None
                message["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                    for c in parsed.calls
                ]
                return message, "tool_calls"
        return message, "length" if turn.truncated else "stop"

    def _tool_call_parser(self) -> Any:
        with self._parser_lock:
            if self._parser is None:
                from rlcore.chat.tool_calls import get_tool_call_parser

                self._parser = get_tool_call_parser(self.settings.tool_call_parser)
            return self._parser


def _turn(out: Any, prompt: list[int], limit: int) -> Turn:
    """The turn from a one-row generation output, its completion cut to ``limit`` tokens (marked truncated)."""
    start, count = len(prompt), int(out["generation_lengths"][0])
    ids = out["output_ids"][0, start : start + count].tolist()
    logprobs = [float(x) for x in out["logprobs"][0, start : start + count].tolist()]
    truncated = bool(out["truncated"][0]) if "truncated" in out else False
    versions = None
    if "generation_weight_versions" in out:
        versions = [int(v) for v in out["generation_weight_versions"][0, start : start + count].tolist()]
    if count > limit:  # the first `limit` tokens are what a request for `limit` tokens would have sampled
        ids, logprobs, truncated = ids[:limit], logprobs[:limit], True
        versions = versions[:limit] if versions is not None else None
    version = int(out["weight_version"][0]) if "weight_version" in out else None
    window = None
    if "generation_window" in out:
        begin, end = (float(x) for x in out["generation_window"][0])
        window = (begin, end)
    return Turn(prompt, ids, logprobs, version, versions, window, truncated)
