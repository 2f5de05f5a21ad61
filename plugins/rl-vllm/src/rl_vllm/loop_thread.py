"""The thread of an :class:`rl_vllm.engine_loop.EngineLoop`: the one caller of its vLLM ``LLMEngine``.

Each iteration is one tick: a command the actor's threads posted, or the admission of the queued requests
and one engine step. Alone (``tensor_parallel_size`` 1) the thread decides and runs its ticks; at
``tensor_parallel_size`` > 1 tensor-parallel rank 0's thread leads (each tick is published before it runs, once
every follower reported the previous one done) and the other ranks' threads follow, applying the leader's
ticks in order (:mod:`rl_vllm.lockstep`). Every step's new tokens are tagged with the tick's weight version.

Versions are kept as spans: a request starts one at admission, and each tick whose version differs from the
last step's starts a new one at the token count each running request has reached. That count comes from the
engine (``progress``, :mod:`rl_vllm.engine_progress`) where it can be read, and the requests then ask for
their final output only; otherwise from per-step (``DELTA``) outputs.

Imports nothing heavy: the engine and the sampling parameters come from the caller.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Literal

from rl_vllm.lockstep import OUTCOME_WAIT_S, REQUEST_WAIT_S, Lockstep, Tick
from rl_vllm.served import EngineLoopError, LoopRequest, Served, reason_of, versions_of

LoopState = Literal["serving", "draining", "paused"]


#: The commands a loop runs between two steps, by name (a follower replays the leader's by name).
COMMANDS = ("abort_running", "reset_prefix_cache")


class LoopThread:
    """The state of an engine loop and the thread that serves ``engine`` (a vLLM ``LLMEngine``); the calls the
    actor's threads make are :class:`rl_vllm.engine_loop.EngineLoop`'s.

    ``current`` answers, at admission and before each step, ``(weight version, lora request or None)``;
    ``name`` (e.g. ``"engine 0"``) prefixes every error. ``logprobs_of(token_ids, logprobs)`` turns a step's
    delta logprobs into floats (``rl_vllm.sampling.sampled_logprobs``). ``lockstep``: this rank's end of a
    tensor-parallel engine's tick channel (None at ``tensor_parallel_size`` 1: the loop decides alone).
    ``progress(engine request id)``: the tokens a running request has generated so far, read from the engine;
    with it the requests ask for their final output only (:attr:`final_only`), without it for each step's.
    ``outcome_wait_s``: how long a follower's lifecycle call waits for the leader's outcome while the leader
    publishes no tick (a pause's ``timeout_s`` is added); then ``TimeoutError`` naming the engine.
    """

    def __init__(
        self,
        engine: Any,
        name: str,
        current: Callable[[], tuple[int, Any]],
        logprobs_of: Callable[[list[int], Any], list[float]],
        lockstep: Lockstep | None = None,
        progress: Callable[[str], int] | None = None,
        request_wait_s: float = REQUEST_WAIT_S,
        outcome_wait_s: float = OUTCOME_WAIT_S,
    ) -> None:
        self._engine = engine
        self.name = name
        self._current = current
        self._logprobs_of = logprobs_of
        self._lockstep = lockstep
        self._progress = progress
        self._stepped_version: int | None = None  # the weight version of the last step
        self._request_wait_s = request_wait_s
        self._outcome_wait_s = outcome_wait_s
        self._cond = threading.Condition()
        self._queued: dict[str, LoopRequest] = {}  # key -> submitted, not admitted (also: aborted, to restart)
        self._running: dict[str, LoopRequest] = {}  # engine id -> request
        self._commands: deque[tuple[str, Future[Any]]] = deque()
        self._state: LoopState = "serving"
        self._acted: LoopState = "serving"  # the state the last iteration ran in (the leader published it)
        self._ticks = 0  # iterations run: by the leader (or alone), or applied by a follower
        self._published = 0  # ticks the leader published (each before it runs)
        self._confirmed = 0  # ticks every follower reported done (the leader's gate before the next)
        self._busy = False  # inside a step or a command
        self._holds = 0  # parked() users: the loop neither steps nor runs commands
        self._stopping = False
        self._error: BaseException | None = None
        self._ids = itertools.count()
        self._keys = itertools.count()
        self.steps = 0
        self._thread = threading.Thread(target=self._run, name=f"rl-vllm {name} loop", daemon=True)
        self._thread.start()

    @property
    def final_only(self) -> bool:
        """Requests ask for their final output only (``RequestOutputKind.FINAL_ONLY``), else for each step's."""
        return self._progress is not None

    def _generated(self, request: LoopRequest) -> int:
        """Tokens ``request`` (running) has generated so far."""
        if self._progress is None:
            return len(request.served.token_ids)
        return self._progress(str(request.engine_id))

    @property
    def follows(self) -> bool:
        """A follower: its engine calls are the leading rank's ticks."""
        return self._lockstep is not None and not self._lockstep.leader

    # -- the loop thread -------------------------------------------------------------------------------------
    def _raise_if_down(self) -> None:
        if self._error is not None:
            raise EngineLoopError(f"{self.name}: the engine loop failed: {reason_of(self._error)}") from self._error
        if self._stopping:
            raise EngineLoopError(f"{self.name}: the engine has been shut down")

    def _has_work(self) -> bool:
        if self._holds:
            return False
        if self._commands or self._state != self._acted:  # a state change is a tick of its own
            return True
        if self._state == "serving":
            return bool(self._queued or self._running)
        return self._state == "draining"

    def _run(self) -> None:
        try:
            if self.follows:
                self._follow()
            else:
                self._lead()
        except BaseException as exc:  # noqa: BLE001 - every waiting caller gets it, naming the engine
            with self._cond:
                self._error = exc
                self._cond.notify_all()
            if self._lockstep is not None and self._lockstep.leader:
                self._tell_followers(f"{self.name}: {reason_of(exc)}")
            elif self.follows:
                self._report_failure(reason_of(exc))
            self._fail_all(EngineLoopError(f"{self.name}: the engine loop failed: {reason_of(exc)}"))

    def _lead(self) -> None:
        """Decide each iteration and run it. When others follow, it is published as a tick once every follower
        reported the previous one done, and a tick that admits requests runs once every follower has taken them
        (a follower that cannot fails before the step's collective, which the leader then never enters)."""
        while True:
            with self._cond:
                while not self._stopping and not self._has_work():
                    self._cond.wait()
                if self._stopping:
                    return
            if self._lockstep is not None and self._confirmed < self._ticks:
                if not self._lockstep.followers_done(self._ticks - 1):
                    return  # stopped
                self._confirmed = self._ticks
            with self._cond:
                if self._stopping:
                    return
                if not self._has_work():  # e.g. a refit parked the loop meanwhile
                    continue
                self._busy = True
                tick, admitted, future = self._decide()
            try:
                if self._lockstep is not None:
                    self._lockstep.publish(self._ticks, tick)
                    self._published += 1  # only this thread writes it
                    if tick.admit and not self._lockstep.followers_done(self._ticks):
                        self._requeue(tick, admitted, future)
                        return  # stopped
                self._execute(tick, admitted, future)
            except BaseException:
                self._requeue(tick, admitted, future)  # failed with the rest of the requests
                raise
            finally:
                self._ran(tick)

    def _requeue(self, tick: Tick, admitted: list[LoopRequest], future: Future[Any] | None) -> None:
        """Leader: an iteration that did not run gives its requests (not admitted yet) and command back, for
        :meth:`_fail_all`."""
        with self._cond:
            for request in admitted:
                if request.engine_id not in self._running and not request.future.done():
                    self._queued[request.key] = request
            if future is not None and not future.done():
                self._commands.appendleft((str(tick.command), future))

    def _decide(self) -> tuple[Tick, list[LoopRequest], Future[Any] | None]:
        """The next iteration (under the lock): one command, or the queued requests' admission and a step."""
        version = int(self._current()[0])
        if self._commands:
            name, future = self._commands.popleft()
            return Tick(self._state, version, command=name), [], future
        admitted: list[LoopRequest] = []
        if self._state == "serving":
            admitted = list(self._queued.values())
            self._queued.clear()
            for request in admitted:
                request.engine_id = f"rlcore-{next(self._ids)}"
        return Tick(self._state, version, admit=[(r.key, str(r.engine_id)) for r in admitted]), admitted, None

    def _follow(self) -> None:
        """Apply the leader's ticks in order; never while this rank's own refit holds the engine."""
        assert self._lockstep is not None
        while True:
            tick = self._lockstep.next_tick(self._ticks)
            if tick is None:
                return
            if tick.error is not None:
                raise EngineLoopError(f"the leading rank stopped: {tick.error}")
            with self._cond:
                while self._holds and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                self._busy = True
                self._state = tick.state  # type: ignore[assignment]
                try:
                    admitted = self._take(tick.admit)
                except BaseException:
                    self._busy = False
                    raise
            if tick.admit and not self._stopping:
                self._lockstep.report(self._ticks)  # taken: the leader may step with them
            try:
                self._execute(tick, admitted, None)
            finally:
                self._ran(tick)
            self._lockstep.report(self._ticks - 1)

    def _take(self, admit: list[tuple[str, str]]) -> list[LoopRequest]:
        """Follower, under the lock: the requests a tick admits, waiting (bounded) for any not received yet."""
        deadline = time.monotonic() + self._request_wait_s
        taken = []
        for key, engine_id in admit:
            while key not in self._queued and not self._stopping:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EngineLoopError(
                        f"{self.name}: the leading rank admitted request {key!r}, which did not reach this rank "
                        f"within {self._request_wait_s}s (every rank of a tensor-parallel engine must get the "
                        "same generate call)"
                    )
                self._cond.wait(left)
            if self._stopping:
                return []
            request = self._queued.pop(key)
            request.engine_id = engine_id
            taken.append(request)
        return taken

    def _ran(self, tick: Tick) -> None:
        with self._cond:
            self._busy = False
            self._ticks += 1
            self._acted = tick.state  # type: ignore[assignment]
            if self._state == "draining" and not self._running and not self.follows:
                self._state = "paused"  # the next tick says so
            self._cond.notify_all()

    def _execute(self, tick: Tick, admitted: list[LoopRequest], future: Future[Any] | None) -> None:
        if tick.command is not None:
            try:
                result = self._abort_running() if tick.command == "abort_running" else self._reset_prefix_cache()
            except Exception as exc:  # noqa: BLE001 - the caller re-raises it (a follower's has none)
                if future is not None:
                    future.set_exception(exc)
                return
            if future is not None:
                future.set_result(result)
            return
        if self._running and tick.version != self._stepped_version:
            self._start_spans(tick.version)
        self._admit(admitted, tick.version)
        if self._running:
            self._step()
            self._stepped_version = tick.version

    def _start_spans(self, version: int) -> None:
        """The weights changed since the last step: each running request's next tokens start a span of ``version``."""
        with self._cond:
            running = list(self._running.values())
        for request in running:
            spans = request.served.spans
            if spans[-1][1] != version:
                spans.append((self._generated(request), version))

    def _admit(self, requests: list[LoopRequest], version: int) -> None:
        lora = self._current()[1]
        for request in requests:
            prompt = {"prompt_token_ids": request.prompt_token_ids, "cache_salt": f"v{version}"}
            if request.multi_modal_data is not None:
                prompt["multi_modal_data"] = request.multi_modal_data
            try:  # a request that cannot start fails alone
                self._engine.add_request(request.engine_id, prompt, request.params.clone(), lora_request=lora)
            except Exception as exc:  # noqa: BLE001 - reported to its caller
                request.future.set_exception(exc)
                continue
            request.served.spans = [(0, version)]
            with self._cond:  # other threads read it (running, tokens_so_far)
                self._running[str(request.engine_id)] = request

    def _step(self) -> None:
        outputs = self._engine.step()
        self.steps += 1
        for output in outputs:
            request = self._running.get(output.request_id)
            if request is None:  # aborted meanwhile
                continue
            done = output.outputs[0]
            tokens = list(done.token_ids)
            served = request.served
            if request.multi_modal_data is not None and served.prompt_token_ids is None:
                served.prompt_token_ids = list(output.prompt_token_ids or [])  # vLLM expanded the images
            served.token_ids += tokens
            served.logprobs += self._logprobs_of(tokens, done.logprobs)
            if output.finished:
                served.versions = versions_of(served.spans, len(served.token_ids))
                served.finish_reason = done.finish_reason
                with self._cond:
                    del self._running[output.request_id]
                request.future.set_result(served)

    def _abort_running(self) -> int:
        """Abort every running request in the engine and queue it again, first, from its prompt."""
        with self._cond:
            aborted = list(self._running.values())
            self._running.clear()
        if aborted:
            self._engine.abort_request([r.engine_id for r in aborted])
        with self._cond:
            for request in aborted:
                request.served = Served(restarts=request.served.restarts + 1)
            self._queued = {**{r.key: r for r in aborted}, **self._queued}
        return len(aborted)

    def _reset_prefix_cache(self) -> Any:
        """vLLM preempts the running requests (their tokens so far stay) and drops every cached prefix."""
        return self._engine.reset_prefix_cache(reset_running_requests=True)

    def _tell_followers(self, error: str) -> None:
        """Leader: a last tick that fails the followers' loops (best effort: the store may be gone)."""
        assert self._lockstep is not None
        try:
            self._lockstep.publish(self._ticks, Tick(self._state, 0, error=error))
        except Exception:  # noqa: BLE001 - the followers then fail on the store instead
            pass

    def _report_failure(self, reason: str) -> None:
        """Follower: tell the leader this rank's loop failed or stopped (best effort: the store may be gone), so
        it stops before a collective this rank will not join."""
        assert self._lockstep is not None
        try:
            self._lockstep.report(self._ticks, error=reason)
        except Exception:  # noqa: BLE001 - the leader then notices the silence
            pass

    def _fail_all(self, error: BaseException) -> None:
        with self._cond:
            waiting = [*self._running.values(), *self._queued.values()]
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
