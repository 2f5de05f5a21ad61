"""The OpenAI request fields the endpoint honours, checked; and its responses, built.

A field is either done as OpenAI documents it or refused with a 400 that names it and says why: the endpoint
serves rollouts, so what the engine samples must be what the trainer assumes. Sampling (``temperature``, ``top_p``,
``top_k``) is the run's ``policy.generation``: a request may repeat those values or leave them out, never change
them. One choice per request (``n: 1``), the sampled token's logprob only (``top_logprobs: 0``). ``stream: true``
is answered as server-sent events once the completion is whole (:func:`sse_events`): one chunk with the whole
message, then the usage chunk when ``stream_options.include_usage`` asks for it, then ``[DONE]``.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

#: Fields a request may carry that change nothing here (the ones rlcore reads are checked on their own).
NEUTRAL_FIELDS = frozenset({"user", "metadata", "store", "parallel_tool_calls", "return_token_ids"})


class ApiError(Exception):
    """A request the endpoint refuses: HTTP ``status``, OpenAI's error body (``message``, ``param``)."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


@dataclass(frozen=True)
class Sampling:
    """The run's sampling settings (``policy.generation``) and limits, which every request gets."""

    model: str
    temperature: float
    top_p: float
    top_k: int | None
    max_new_tokens: int


@dataclass
class ChatRequest:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    parse_tools: bool  # tools given and tool_choice is not "none"
    max_tokens: int
    stop: list[str] | None
    logprobs: bool


@dataclass
class CompletionRequest:
    prompt_text: str | None
    prompt_ids: list[int] | None
    max_tokens: int
    stop: list[str] | None
    logprobs: bool


def chat_request(body: Any, sampling: Sampling, greedy: bool) -> ChatRequest:
    """A ``chat/completions`` body, checked (:class:`ApiError` on what the endpoint does not do)."""
    body = _common(body, sampling, greedy, handled={"messages", "tools", "tool_choice", "logprobs", "top_logprobs"})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise ApiError(400, "messages: expected a non-empty list of {role, content} messages", "messages")
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ApiError(400, "tools: expected a list of function-tool schemas", "tools")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise ApiError(
            400,
            f"tool_choice: {choice!r} is not served: only 'auto' and 'none' (the policy decides whether to call a "
            "tool; rlcore does not constrain what it samples)",
            "tool_choice",
        )
    top = body.get("top_logprobs")
    if top not in (None, 0):
        raise ApiError(
            400, "top_logprobs: only 0 is served (the engine returns the sampled token's logprob)", "top_logprobs"
        )
    return ChatRequest(
        messages=[dict(m) for m in messages],
        tools=list(tools) if tools else None,
        parse_tools=bool(tools) and choice != "none",
        max_tokens=_max_tokens(body, sampling),
        stop=_stop(body),
        logprobs=_flag(body, "logprobs"),
    )


def completion_request(body: Any, sampling: Sampling, greedy: bool) -> CompletionRequest:
    """A ``completions`` body, checked: ``prompt`` is one text or one list of token ids."""
    body = _common(body, sampling, greedy, handled={"prompt", "logprobs", "echo", "suffix", "best_of"})
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    text = prompt if isinstance(prompt, str) and prompt else None
    ids = prompt if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt) else None
    if text is None and ids is None:
        raise ApiError(400, "prompt: expected one non-empty text or one list of token ids", "prompt")
    for name, allowed in (("echo", (None, False)), ("suffix", (None, "")), ("best_of", (None, 1))):
        if body.get(name) not in allowed:
            raise ApiError(400, f"{name}: {body.get(name)!r} is not served", name)
    logprobs = body.get("logprobs")
    if logprobs not in (None, 0, 1) or isinstance(logprobs, bool):
        raise ApiError(400, "logprobs: only 0 or 1 is served (the sampled token's logprob)", "logprobs")
    return CompletionRequest(text, ids, _max_tokens(body, sampling), _stop(body), logprobs is not None)


def _common(body: Any, sampling: Sampling, greedy: bool, handled: set[str]) -> dict[str, Any]:
    """The checks every request gets: the model, one choice, the stream flags, the run's sampling, no unknown
    field."""
    body = request_object(body, sampling.model)
    if body.get("n") not in (None, 1):
        raise ApiError(400, "n: only 1 is served (one completion per request; send more requests)", "n")
    _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise ApiError(400, "stream_options: only {include_usage: true|false} is served", "stream_options")
    if options is not None and body.get("stream") is not True:
        raise ApiError(400, "stream_options: only with stream: true", "stream_options")
    _flag(options or {}, "include_usage")
    for name, value in (("temperature", sampling.temperature), ("top_p", sampling.top_p), ("top_k", sampling.top_k)):
        asked = body.get(name)
        if name == "top_k" and asked in (-1, 0) and value is None:
            asked = None  # vLLM's spelling of 'off'
        if asked is None or (greedy and name == "temperature" and asked == 0):
            continue
        if value is None or isinstance(asked, bool) or not isinstance(asked, (int, float)) or abs(asked - value) > 1e-9:
            raise ApiError(
                400,
                f"{name}: {asked!r} differs from the run's policy.generation.{name} ({value!r}), which the trainer "
                f"assumes the tokens were sampled with; leave {name} out or send {value!r}",
                name,
            )
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name) not in (None, 0, 0.0):
            raise ApiError(400, f"{name}: penalties are not served (the trainer assumes plain sampling)", name)
    if body.get("seed") is not None:
        raise ApiError(
            400, "seed: the server seeds each request itself (reproducible rollouts); leave seed out", "seed"
        )
    known = handled | NEUTRAL_FIELDS | {"model", "n", "stream", "stream_options", "temperature", "top_p", "top_k"}
    known |= {"seed", "presence_penalty", "frequency_penalty", "stop", "max_tokens", "max_completion_tokens"}
    refuse_unknown(body, known)
    return body


def request_object(body: Any, model: str) -> dict[str, Any]:
    """``body`` as a JSON object for ``model`` (a request naming another model gets a 404)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    asked = body.get("model")
    if asked is not None and asked != model:
        raise ApiError(404, f"model {asked!r} is not served here; this endpoint serves {model!r}", "model")
    return body


def refuse_unknown(body: dict[str, Any], known: set[str]) -> None:
    """A 400 naming the first field of ``body`` not in ``known``: a field is done or refused, never ignored."""
    if unknown := sorted(set(body) - known):
        raise ApiError(400, f"{unknown[0]}: this field is not served by rlcore's endpoint", unknown[0])


def _max_tokens(body: dict[str, Any], sampling: Sampling) -> int:
    """The request's token limit, at most the run's ``policy.generation.max_new_tokens``."""
    limit = sampling.max_new_tokens
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ApiError(400, f"{name}: expected a positive integer, got {value!r}", name)
        limit = min(limit, value)
    return limit


def _stop(body: dict[str, Any]) -> list[str] | None:
    stop = body.get("stop")
    if stop is None:
        return None
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ApiError(400, "stop: expected a string or a list of strings", "stop")
    return [s for s in stops if s] or None


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value not in (None, True, False):
        raise ApiError(400, f"{name}: expected true or false", name)
    return bool(value)


def token_logprobs(tokenizer: Any, ids: list[int], logprobs: list[float]) -> list[dict[str, Any]]:
    """OpenAI's ``logprobs.content``: each generated token's text and logprob (no alternatives)."""
    out = []
    for token, value in zip(ids, logprobs):
        text = tokenizer.decode([token])
        out.append({"token": text, "logprob": value, "bytes": list(text.encode("utf-8")), "top_logprobs": []})
    return out


def chat_response(
    sampling: Sampling,
    message: dict[str, Any],
    finish_reason: str,
    prompt_ids: list[int],
    generated: list[int],
    logprobs: list[float],
    logprobs_content: list[dict[str, Any]] | None,
    weight_version: int | None,
) -> dict[str, Any]:
    """A ``chat.completion`` with vLLM's token ids (``prompt_token_ids``, the choice's ``token_ids``) and rlcore's
    ``generation_logprobs`` (the engine's logprob of each generated token) and ``weight_version``."""
    choice = {
        "index": 0,
        "message": message,
        "finish_reason": finish_reason,
        "logprobs": {"content": logprobs_content} if logprobs_content is not None else None,
        "token_ids": generated,
        "generation_logprobs": logprobs,
    }
    return _response("chat.completion", "chatcmpl", sampling, choice, prompt_ids, generated, weight_version)


def completion_response(
    sampling: Sampling,
    text: str,
    finish_reason: str,
    prompt_ids: list[int],
    generated: list[int],
    logprobs: list[float],
    tokens: list[str] | None,
    weight_version: int | None,
) -> dict[str, Any]:
    """A ``text_completion`` with the token ids and logprobs as :func:`chat_response` gives them."""
    legacy = None
    if tokens is not None:
        offsets, at = [], 0
        for token in tokens:
            offsets.append(at)
            at += len(token)
        legacy = {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": None, "text_offset": offsets}
    choice = {
        "index": 0,
        "text": text,
        "finish_reason": finish_reason,
        "logprobs": legacy,
        "token_ids": generated,
        "generation_logprobs": logprobs,
    }
    return _response("text_completion", "cmpl", sampling, choice, prompt_ids, generated, weight_version)


def _response(
    kind: str,
    id_prefix: str,
    sampling: Sampling,
    choice: dict[str, Any],
    prompt_ids: list[int],
    generated: list[int],
    weight_version: int | None,
) -> dict[str, Any]:
    """The response around one ``choice``, with the prompt's token ids and the weights' version."""
    return {
        "id": f"{id_prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": sampling.model,
        "choices": [choice],
        "usage": _usage(prompt_ids, generated),
        "prompt_token_ids": prompt_ids,
        "weight_version": weight_version,
    }


def streamed(body: Any) -> tuple[bool, bool]:
    """``(stream, include_usage)`` of a request that passed the checks."""
    if not isinstance(body, dict) or body.get("stream") is not True:
        return False, False
    return True, bool((body.get("stream_options") or {}).get("include_usage"))


def sse_events(response: dict[str, Any], include_usage: bool) -> bytes:
    """A whole ``chat.completion`` or ``text_completion`` as OpenAI's stream of it: one chunk holding the whole
    message (a tool call's ``index`` added), the usage chunk if asked for, ``[DONE]``. The token ids, logprobs and
    weight version stay on the chunk."""
    choice = dict(response["choices"][0])
    if response["object"] == "chat.completion":
        delta = dict(choice.pop("message"))
        if delta.get("tool_calls"):
            delta["tool_calls"] = [{**call, "index": i} for i, call in enumerate(delta["tool_calls"])]
        choice = {"index": 0, "delta": delta, **{k: v for k, v in choice.items() if k != "index"}}
        kind = "chat.completion.chunk"
    else:
        kind = "text_completion"
    chunk = {**response, "object": kind, "choices": [choice], "usage": None}
    events = [chunk]
    if include_usage:
        events.append({**chunk, "choices": [], "usage": response["usage"]})
    return b"".join(f"data: {json.dumps(event)}\n\n".encode() for event in events) + b"data: [DONE]\n\n"


def models_response(sampling: Sampling) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": sampling.model, "object": "model", "created": 0, "owned_by": "rlcore"}],
    }


def _usage(prompt_ids: list[int], generated: list[int]) -> dict[str, int]:
    return {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(generated),
        "total_tokens": len(prompt_ids) + len(generated),
    }
