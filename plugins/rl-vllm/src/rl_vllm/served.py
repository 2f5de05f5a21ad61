"""What an engine loop's requests are (:mod:`rl_vllm.engine_loop`): a request as the loop holds it, what it
produced, and the loop's error; plain data, importing nothing heavy."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Served:
    """What one request produced: its tokens, their logprobs, and the weight version of each token (``versions``,
    filled when it finishes from ``spans``: ``(index of the first token, version)`` of each run of tokens one
    weight version produced, oldest first)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)
    finish_reason: str | None = None
    restarts: int = 0  # times an ``abort`` pause dropped its partial output and it started again
    prompt_token_ids: list[int] | None = None  # vLLM's prompt, recorded for a request with images (it expands them)


@dataclass
class LoopRequest:
    key: str  # the same on every rank of a tensor-parallel engine
    prompt_token_ids: list[int]
    params: Any  # vllm.SamplingParams (output_kind: see EngineLoop.final_only); cloned at every (re-)admission
    future: Future[Served]
    served: Served = field(default_factory=Served)
    engine_id: str | None = None  # the id of its current admission (a restart gets a new one)
    multi_modal_data: Any = None  # vLLM's ``multi_modal_data`` of the prompt (images), or None


#: A request's prompt: its token ids, or vLLM's prompt dict (``prompt_token_ids``, ``multi_modal_data``).
Prompt = Sequence[int] | Mapping[str, Any]


def loop_request(key: str, prompt: Prompt, params: Any) -> LoopRequest:
    """A new request of ``prompt`` (ids, or a dict with images) as the engine loop holds it."""
    if isinstance(prompt, Mapping):
        images = prompt.get("multi_modal_data")
        return LoopRequest(key, list(prompt["prompt_token_ids"]), params, Future(), multi_modal_data=images)
    return LoopRequest(key, list(prompt), params, Future())


def versions_of(spans: Sequence[tuple[int, int]], count: int) -> list[int]:
    """Each of ``count`` tokens' weight version, from the ``spans`` that produced them (see :class:`Served`)."""
    versions: list[int] = []
    for (start, version), (end, _) in zip(spans, [*spans[1:], (count, -1)]):
        if not 0 <= start <= end <= count:
            raise EngineLoopError(f"weight-version spans {list(spans)} do not fit a request of {count} tokens")
        versions += [version] * (end - start)
    return versions


class EngineLoopError(RuntimeError):
    """The engine loop failed or was stopped; names the engine."""


def reason_of(exc: BaseException) -> str:
    """``exc`` as one line: its type, and its message when it has one."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
