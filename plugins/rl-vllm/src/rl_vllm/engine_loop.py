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

At ``tensor_parallel_size`` > 1 every rank runs an engine loop, and the ranks must make the same engine calls in
the same order: tensor-parallel rank 0's loop leads and the others follow its ticks (:mod:`rl_vllm.lockstep`).
A request is known on every rank by its ``key`` (the facade's call id and the row), commands by their name.
This module is the side the actor's threads call; the thread itself is :mod:`rl_vllm.loop_thread`.

Imports nothing heavy: the engine and the sampling parameters come from the caller.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any, Literal

from rl_vllm.lockstep import Outcome
from rl_vllm.loop_thread import COMMANDS, LoopState, LoopThread
from rl_vllm.served import EngineLoopError, LoopRequest, Prompt, Served, loop_request


class EngineLoop(LoopThread):
    """Serves ``engine`` (a vLLM ``LLMEngine``) from one thread; see the module docstring, and
    :class:`rl_vllm.loop_thread.LoopThread` for the arguments."""

    # -- the actor's side -----------------------------------------------------------------------------------
    @property
    def state(self) -> LoopState:
        return self._state

    def submit(self, prompt: Prompt, params: Any, key: str | None = None) -> Future[Served]:
        """Queue one request; it is admitted at the next step while serving, else at resume. ``key`` names it
        on every rank of a tensor-parallel engine (the leader's ticks admit it by key). ``prompt``: its token
        ids, or vLLM's prompt dict (``prompt_token_ids`` and ``multi_modal_data``, see ``rl_vllm.multimodal``)."""
        return self.submit_all([(prompt, params, key)])[0]

    def submit_all(self, requests: Sequence[tuple[Prompt, Any, str | None]]) -> list[Future[Served]]:
        """Queue ``(prompt, params, key)`` requests at once: the loop admits them all at its next step
        (one call's sample groups enter the running batch together, not over several steps)."""
        with self._cond:
            self._raise_if_down()
            taken = set(self._queued) | {r.key for r in self._running.values()}
            new: dict[str, LoopRequest] = {}
            for prompt, params, key in requests:
                key = f"auto-{next(self._keys)}" if key is None else key
                if key in taken or key in new:
                    raise ValueError(f"{self.name}: request {key!r} was submitted twice")
                new[key] = loop_request(key, prompt, params)
            self._queued.update(new)  # all or none
            self._cond.notify_all()
        return [request.future for request in new.values()]

    def command(self, name: str) -> Any:
        """Run the named command (one of :data:`COMMANDS`) on the loop thread between two steps (paused or not)
        and return its result. A follower runs the leader's commands from its ticks, never its own."""
        if name not in COMMANDS:
            raise ValueError(f"{self.name}: unknown engine loop command {name!r}; one of {list(COMMANDS)}")
        if self.follows:
            raise RuntimeError(f"{self.name}: a following rank runs only the leading rank's commands")
        future: Future[Any] = Future()
        with self._cond:
            self._raise_if_down()
            self._commands.append((name, future))
            self._cond.notify_all()
        return future.result()

    def pause(self, mode: Literal["abort", "wait", "keep"], timeout_s: float | None = None) -> None:
        """Stop between two steps (see ``GenerationInterface.pause_generation``); ``TimeoutError`` naming the
        engine when not paused within ``timeout_s`` (a ``wait`` that timed out goes back to serving)."""
        self._led("pause", lambda: self._pause_here(mode, timeout_s), timeout_s)

    def resume(self, recompute_kv_cache: bool = False) -> None:
        """Serve again; queued requests are admitted. ``recompute_kv_cache``: vLLM preempts the requests kept
        across the pause (their tokens so far stay), and they prefill again with the current weights."""
        self._led("resume", lambda: self._resume_here(recompute_kv_cache))

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Hold the engine for a refit: directly when paused; otherwise pause in ``wait`` mode (running requests
        finish on the old weights), run the block parked, and resume. At ``tensor_parallel_size`` > 1 every rank
        holds at the same tick, decided by the leader (a follower never steps while its own refit loads)."""
        was = self._led("hold", self._hold_here).was
        try:
            with self.parked():
                yield
        finally:
            if was == "serving":
                self.resume()

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
        """Tokens generated so far by each admitted request, in admission order (stable while paused). Read
        while serving, a request the engine finished in the step under way has left vLLM's output processor
        already and counts the tokens handed out to it so far."""
        with self._cond:
            running = list(self._running.values())
        counts = []
        for request in running:
            try:
                counts.append(self._generated(request))
            except KeyError:
                counts.append(len(request.served.token_ids))
        return counts

    def stop(self, timeout_s: float = 30.0) -> None:
        """End the thread; every request not finished fails with an error naming the engine. A leader tells its
        followers (their requests fail too, instead of waiting for ticks that will not come)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self.follows and self._error is None:
            self._report_failure("the rank was shut down")
        if self._lockstep is not None:
            self._lockstep.stop()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        if self._lockstep is not None and self._lockstep.leader and self._error is None:
            self._tell_followers("the engine's leading rank was shut down")
        self._fail_all(EngineLoopError(f"{self.name}: the engine was shut down before the request finished"))

    # -- lifecycle calls, led by tensor-parallel rank 0 -------------------------------------------------------
    def _led(self, kind: str, action: Callable[[], str | None], timeout_s: float | None = None) -> Outcome:
        """Run a lifecycle call here (alone, or as the leader, telling the followers how it ended), or, on a
        follower, mirror the leader's call of the same kind and number: apply every tick it had published by
        then, and raise what it raised. A follower waits for the outcome ``outcome_wait_s`` (+ the call's
        ``timeout_s``) at a time, again while the leader keeps publishing ticks (e.g. a long drain)."""
        lockstep = self._lockstep
        if lockstep is None:
            return Outcome(self._ticks, action())
        k = lockstep.call_number(kind)
        if lockstep.leader:
            # The ticks published by the end of the call (its command's, its pause's) are the followers' to apply.
            try:
                was = action()
            except BaseException as exc:
                failed = Outcome(self._published, error=str(exc), timed_out=isinstance(exc, TimeoutError))
                lockstep.tell(kind, k, failed)
                raise
            outcome = Outcome(self._published, was)
            lockstep.tell(kind, k, outcome)
            return outcome
        try:
            told = lockstep.outcome(kind, k, self._outcome_wait_s + (timeout_s or 0.0), lambda: self._ticks)
        except TimeoutError as exc:
            raise TimeoutError(f"{self.name}: {exc}") from None
        if told is None:
            raise EngineLoopError(f"{self.name}: the engine has been shut down")
        with self._cond:
            while self._error is None and not self._stopping and self._ticks < told.ticks:
                self._cond.wait()
            self._raise_if_down()
        if told.error is not None:
            if told.timed_out:
                raise TimeoutError(told.error)
            raise EngineLoopError(f"{self.name}: the leading rank's {kind} failed: {told.error}")
        return told

    def _pause_here(self, mode: str, timeout_s: float | None) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            self._raise_if_down()
            if mode == "wait":
                if self._state == "serving":
                    self._state = "draining" if self._running else "paused"
            else:
                self._state = "paused"
            self._cond.notify_all()
            while self._error is None and (self._state != "paused" or self._acted != "paused" or self._busy):
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
            self.command("abort_running")

    def _resume_here(self, recompute_kv_cache: bool) -> None:
        if recompute_kv_cache:
            self.command("reset_prefix_cache")
        with self._cond:
            self._raise_if_down()
            self._state = "serving"
            self._cond.notify_all()

    def _hold_here(self) -> str:
        was = self._state
        if was != "paused":  # also when draining for a caller's pause('wait'): that pause then stays
            self._pause_here("wait", None)
        return was
