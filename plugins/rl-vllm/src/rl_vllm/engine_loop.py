"""``EngineLoop``: the thread that serves an in-process vLLM ``LLMEngine`` continuously (``vllm_cfg.async_engine``).

``LLMEngine`` is not thread-safe, so this thread owns every call into it: it admits submitted requests
(``add_request``), steps while requests are in flight, and runs the short commands the actor's threads post
(``call``: abort, prefix-cache reset, LoRA adds) between two steps. Idle, it sleeps on a condition (no busy spin).

Each step's new tokens are tagged with the weight version current when the step ran, so a refit that lands
while requests are kept in flight shows in the per-token versions of their samples.

Why not vLLM's ``AsyncLLM``: it always runs the engine core in a process of its own, where rl-vllm's in-place
refit (the model as an ``nn.Module`` in the actor, loaded tensor by tensor) cannot reach the model. The in-process
``LLMEngine`` driven by ``add_request``/``step`` keeps the model here.

Pause states: ``serving`` (admit and step), ``draining`` (no admits; step until nothing runs, then ``paused``),
``paused`` (neither; requests keep their state). :meth:`parked` lets another thread use the engine exclusively
(a refit) while the loop neither steps nor runs commands.

Imports nothing heavy: the engine and the sampling parameters come from the caller.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal

LoopState = Literal["serving", "draining", "paused"]


@dataclass
class Served:
    """What one request produced: its tokens, their logprobs, and the weight version of each token."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    restarts: int = 0  # times an ``abort`` pause dropped its partial output and it started again


@dataclass
class _Request:
    prompt_token_ids: list[int]
    params: Any  # vllm.SamplingParams with output_kind=DELTA; cloned at every (re-)admission
    future: Future[Served]
    served: Served = field(default_factory=Served)
    engine_id: str | None = None  # the id of its current admission (a restart gets a new one)


class EngineLoopError(RuntimeError):
    """The engine loop failed or was stopped; names the engine."""


class EngineLoop:
    """Serves ``engine`` (a vLLM ``LLMEngine``) from one thread; see the module docstring.

    ``current`` answers, at admission and after each step, ``(weight version, lora request or None)``;
    ``name`` (e.g. ``"engine 0"``) prefixes every error. ``logprobs_of(token_ids, logprobs)`` turns a step's
    delta logprobs into floats (``rl_vllm.sampling.sampled_logprobs``).
    """

    def __init__(
        self,
        engine: Any,
        name: str,
        current: Callable[[], tuple[int, Any]],
        logprobs_of: Callable[[list[int], Any], list[float]],
    ) -> None:
        self._engine = engine
        self.name = name
        self._current = current
        self._logprobs_of = logprobs_of
        self._cond = threading.Condition()
        self._queued: deque[_Request] = deque()  # submitted, not admitted (also: aborted, to restart)
        self._running: dict[str, _Request] = {}  # engine id -> request
        self._commands: deque[tuple[Callable[[Any], Any], Future[Any]]] = deque()
        self._state: LoopState = "serving"
        self._busy = False  # inside a step or a command
        self._holds = 0  # parked() users: the loop neither steps nor runs commands
        self._stopping = False
        self._error: BaseException | None = None
        self._ids = itertools.count()
        self.steps = 0
        self._thread = threading.Thread(target=self._run, name=f"rl-vllm {name} loop", daemon=True)
        self._thread.start()

    # -- the actor's side -----------------------------------------------------------------------------------
    @property
    def state(self) -> LoopState:
        return self._state

    def submit(self, prompt_token_ids: list[int], params: Any) -> Future[Served]:
        """Queue one request; it is admitted at the next step while serving, else at resume."""
        future: Future[Served] = Future()
        with self._cond:
            self._raise_if_down()
            self._queued.append(_Request(list(prompt_token_ids), params, future))
            self._cond.notify_all()
        return future

    def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(engine)`` on the loop thread between two steps (paused or not) and return its result."""
        future: Future[Any] = Future()
        with self._cond:
            self._raise_if_down()
            self._commands.append((fn, future))
            self._cond.notify_all()
        return future.result()

    def pause(self, mode: Literal["abort", "wait", "keep"], timeout_s: float | None = None) -> None:
        """Stop between two steps (see ``GenerationInterface.pause_generation``); ``TimeoutError`` naming the
        engine when not paused within ``timeout_s`` (a ``wait`` that timed out goes back to serving)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            self._raise_if_down()
            if mode == "wait":
                if self._state == "serving":
                    self._state = "draining" if self._running else "paused"
            else:
                self._state = "paused"
            self._cond.notify_all()
            while self._error is None and (self._state != "paused" or self._busy):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    if self._state == "draining":
                        self._state = "serving"
                        self._cond.notify_all()
                    raise TimeoutError(
                        f"{self.name}: not paused within {timeout_s}s ({len(self._running)} request(s) still "
                        f"running in a '{mode}' pause)"
                    )
                self._cond.wait(left)
            self._raise_if_down()
        if mode == "abort":
            self.call(self._abort_running)

    def resume(self, recompute_kv_cache: bool = False) -> None:
        """Serve again; queued requests are admitted. ``recompute_kv_cache``: vLLM preempts the requests kept
        across the pause (their tokens so far stay), and they prefill again with the current weights."""
        if recompute_kv_cache:
            self.call(lambda engine: engine.reset_prefix_cache(reset_running_requests=True))
        with self._cond:
            self._raise_if_down()
            self._state = "serving"
            self._cond.notify_all()

    @contextlib.contextmanager
    def parked(self) -> Iterator[None]:
        """Use the engine from the calling thread: waits until the loop is between two steps and keeps it
        there (no step, no command) until the block ends. Meant for a paused engine (a refit)."""
        with self._cond:
            self._holds += 1
            while self._busy:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._holds -= 1
                self._cond.notify_all()

    def running(self) -> int:
        """Requests admitted and not finished, plus those queued."""
        with self._cond:
            return len(self._running) + len(self._queued)

    def tokens_so_far(self) -> list[int]:
        """Tokens generated so far by each admitted request, in admission order (stable while paused)."""
        with self._cond:
            return [len(r.served.token_ids) for r in self._running.values()]

    def stop(self, timeout_s: float = 30.0) -> None:
        """End the thread; every request not finished fails with an error naming the engine."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        self._fail_all(EngineLoopError(f"{self.name}: the engine was shut down before the request finished"))

    # -- the loop thread -------------------------------------------------------------------------------------
    def _raise_if_down(self) -> None:
        if self._error is not None:
            raise EngineLoopError(f"{self.name}: the engine loop failed: {_reason(self._error)}") from self._error
        if self._stopping:
            raise EngineLoopError(f"{self.name}: the engine has been shut down")

    def _has_work(self) -> bool:
        if self._holds:
            return False
        if self._commands:
            return True
        if self._state == "serving":
            return bool(self._queued or self._running)
        return self._state == "draining"

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._stopping and not self._has_work():
                        self._cond.wait()
                    if self._stopping:
                        return
                    self._busy = True
                    command = self._commands.popleft() if self._commands else None
                    admits = []
                    if command is None and self._state == "serving":
                        admits = list(self._queued)
                        self._queued.clear()
                try:
                    if command is not None:
                        self._run_command(*command)
                    else:
                        self._admit(admits)
                        if self._running:
                            self._step()
                finally:
                    with self._cond:
                        self._busy = False
                        if self._state == "draining" and not self._running:
                            self._state = "paused"
                        self._cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - every waiting caller gets it, naming the engine
            with self._cond:
                self._error = exc
                self._cond.notify_all()
            self._fail_all(EngineLoopError(f"{self.name}: the engine loop failed: {_reason(exc)}"))

    def _run_command(self, fn: Callable[[Any], Any], future: Future[Any]) -> None:
        try:
            future.set_result(fn(self._engine))
        except BaseException as exc:  # noqa: BLE001 - the caller re-raises it
            future.set_exception(exc)

    def _admit(self, requests: list[_Request]) -> None:
        version, lora = self._current()
        for request in requests:
            request.engine_id = f"rlcore-{next(self._ids)}"
            prompt = {"prompt_token_ids": request.prompt_token_ids, "cache_salt": f"v{version}"}
            try:  # a request that cannot start fails alone
                self._engine.add_request(request.engine_id, prompt, request.params.clone(), lora_request=lora)
            except Exception as exc:  # noqa: BLE001 - reported to its caller
                request.future.set_exception(exc)
                continue
            with self._cond:  # other threads read it (running, tokens_so_far)
                self._running[request.engine_id] = request

    def _step(self) -> None:
        outputs = self._engine.step()
        self.steps += 1
        version, _ = self._current()
        for output in outputs:
            request = self._running.get(output.request_id)
            if request is None:  # aborted meanwhile
                continue
            done = output.outputs[0]
            tokens = list(done.token_ids)
            served = request.served
            served.token_ids += tokens
            served.logprobs += self._logprobs_of(tokens, done.logprobs)
            served.versions += [version] * len(tokens)
            if output.finished:
                served.finish_reason = done.finish_reason
                with self._cond:
                    del self._running[output.request_id]
                request.future.set_result(served)

    def _abort_running(self, engine: Any) -> int:
        """Abort every running request in the engine and queue it again, first, from its prompt."""
        with self._cond:
            aborted = list(self._running.values())
            self._running.clear()
        if aborted:
            engine.abort_request([r.engine_id for r in aborted])
        with self._cond:
            for request in reversed(aborted):
                request.served = Served(restarts=request.served.restarts + 1)
                self._queued.appendleft(request)
        return len(aborted)

    def _fail_all(self, error: BaseException) -> None:
        with self._cond:
            waiting = [*self._running.values(), *self._queued]
            self._running.clear()
            self._queued.clear()
            commands = list(self._commands)
            self._commands.clear()
        for request in waiting:
            if not request.future.done():
                request.future.set_exception(error)
        for _, future in commands:
            if not future.done():
                future.set_exception(error)


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
