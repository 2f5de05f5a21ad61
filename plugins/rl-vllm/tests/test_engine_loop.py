"""``EngineLoop``'s orchestration against a scripted stand-in for vLLM's ``LLMEngine`` (no model): a step that
raises reaches every waiting caller naming the engine, a stop fails what is left, and nothing hangs. The real
engine's behaviour is tested in ``test_async_engine.py``."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from rl_vllm.engine_loop import EngineLoop, EngineLoopError

WAIT_S = 5.0


class ScriptedEngine:
    """Each request yields one token per step, ``length`` of them; ``fail_at`` makes that step raise."""

    def __init__(self, length: int = 3, fail_at: int | None = None) -> None:
        self.length, self.fail_at = length, fail_at
        self.requests: dict[str, int] = {}
        self.steps = 0
        self.threads: set[str] = set()

    def add_request(self, request_id: str, prompt: dict, params: Any, lora_request: Any = None) -> None:
        self.threads.add(threading.current_thread().name)
        self.requests[request_id] = 0

    def abort_request(self, ids: list[str]) -> None:
        for i in ids:
            self.requests.pop(i, None)

    def step(self) -> list[Any]:
        self.threads.add(threading.current_thread().name)
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError("kernel exploded")
        outputs = []
        for rid in list(self.requests):
            self.requests[rid] += 1
            finished = self.requests[rid] >= self.length
            token = SimpleNamespace(token_ids=[self.requests[rid]], logprobs=None, finish_reason="length")
            outputs.append(SimpleNamespace(request_id=rid, outputs=[token], finished=finished))
            if finished:
                del self.requests[rid]
        return outputs


class Params:
    def clone(self) -> Params:
        return self


def make_loop(engine: ScriptedEngine, version: list[int]) -> EngineLoop:
    return EngineLoop(engine, "engine 3", lambda: (version[0], None), lambda tokens, _: [-1.0] * len(tokens))


def test_requests_are_served_on_the_loop_thread_with_the_version_of_each_step() -> None:
    engine, version = ScriptedEngine(length=4), [5]
    loop = make_loop(engine, version)
    try:
        first = loop.submit([1, 2], Params())
        served = first.result(WAIT_S)
        assert served.token_ids == [1, 2, 3, 4] and served.versions == [5] * 4 and served.logprobs == [-1.0] * 4
        assert engine.threads == {"rl-vllm engine 3 loop"}
        loop.pause("keep", WAIT_S)
        second = loop.submit([1], Params())
        time.sleep(0.1)
        assert not second.done() and engine.steps == 4, "a request started while paused"
        version[0] = 6
        loop.resume()
        assert second.result(WAIT_S).versions == [6] * 4
    finally:
        loop.stop()


def test_a_raising_step_fails_every_waiting_caller_naming_the_engine() -> None:
    engine = ScriptedEngine(length=10, fail_at=2)
    loop = make_loop(engine, [0])
    try:
        futures = [loop.submit([1], Params()) for _ in range(3)]
        for future in futures:
            with pytest.raises(
                EngineLoopError, match="engine 3: the engine loop failed: RuntimeError: kernel exploded"
            ):
                future.result(WAIT_S)
        with pytest.raises(EngineLoopError, match="engine 3"):
            loop.submit([1], Params())
        with pytest.raises(EngineLoopError, match="engine 3"):
            loop.pause("wait", WAIT_S)
    finally:
        loop.stop()


def test_stop_fails_queued_requests_and_ends_the_thread() -> None:
    loop = make_loop(ScriptedEngine(length=10), [0])
    loop.pause("keep", WAIT_S)
    queued = loop.submit([1], Params())
    loop.stop()
    with pytest.raises(EngineLoopError, match="engine 3: the engine was shut down"):
        queued.result(WAIT_S)
    assert not any(t.name == "rl-vllm engine 3 loop" for t in threading.enumerate())
