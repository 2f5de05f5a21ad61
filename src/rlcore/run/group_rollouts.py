"""Ready-first rollouts: each sample group on its own, handled as it finishes, for an engine that serves
requests continuously (``GenerationInterface.continuous_serving``, vLLM's async engine).

A sample group is the ``repeat`` copies of one prompt. Each group's turn is one ``generate_async`` call; the
results are taken in the order they finish (``as_completed``). A finished group is scored by the environment
(its own samples only), gets its observations, and its next turn is submitted at once, while the other groups
are still generating: a slow group no longer holds back the turns of the fast ones, and the environment
scores while the engine generates.

Nothing else changes: each request is the one the whole-batch turn would make for those samples (the same
tokens, stop strings and per-request seeds: same data row, copy and turn, same seed), so an engine that
honours the seeds gives the same completions, and the rollout (tokens, masks, logprobs, rewards, metrics, rows
in sample order) is the same as the whole-batch path's. The environment must score each sample on its own
(its answer for a sample may not depend on which others share the call), which the environment contract asks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from rlcore.run.step import Timer


class GroupTurns(Protocol):
    """What a ready-first rollout needs of the rollout's turn work (:class:`rlcore.run.rollouts.RolloutTurns`;
    named here as a protocol so that this module does not import the one that imports it)."""

    repeat: int
    max_turns: int
    state: Any  # rlcore.run.rollouts.Trajectories: per-sample ``done`` flags

    def request(self, active: list[int], turn: int) -> Any: ...

    def take(self, active: list[int], batch: Any, out: Any) -> None: ...

    def score(self, active: list[int], turn: int, timer: Timer) -> None: ...


@dataclass
class GroupRequest:
    """One group's turn in flight: the engine's handle, the group, the turn, which samples, and what was asked."""

    handle: Any
    group: int
    turn: int
    active: list[int]
    batch: Any


def first_done(generation: Any, handles: list[Any]) -> tuple[int, Any]:
    """``(index, output)`` of the first of ``handles`` to finish, from the backend's ``as_completed``.

    Asked again after each result (with the requests submitted meanwhile), so the generator is closed after
    its first item: the handles it did not yield stay in flight, to be collected by a later call."""
    results = generation.as_completed(handles)
    try:
        return next(iter(results))
    finally:
        close = getattr(results, "close", None)
        if close is not None:
            close()


def ready_now(generation: Any, handles: list[Any]) -> list[tuple[int, Any]]:
    """``(index, output)`` of every one of ``handles`` already done, without waiting (``as_completed`` with a
    timeout of 0, for a backend whose ``as_completed`` honours timeouts)."""
    done = []
    results = generation.as_completed(handles, timeout_s=0)
    try:
        for item in results:
            done.append(item)
    except TimeoutError:
        pass
    finally:
        close = getattr(results, "close", None)
        if close is not None:
            close()
    return done


def roll_out_ready_first(turns: GroupTurns, generation: Any, greedy: bool, timer: Timer) -> None:
    """Roll out every group of ``turns``' samples through ``generation``, each group's turns one after another and
    the groups side by side, handling whichever finishes first.

    A backend with ``generate_groups_async(batches, greedy=)`` (one handle per batch; rl-vllm's: one streaming
    call per engine, the groups admitted together and handed back as each finishes) gets the first turns of
    every group in one call, and the next turns of the groups done at the same moment together; any other
    backend one ``generate_async`` call per group's turn.

    The phases overlap here, so they measure: ``time/generation_s``, the wall time from the first submission
    until the last group's last output is in (scoring of the groups done earlier falls inside it);
    ``time/environment_s``, the time spent in the environment's calls, summed."""
    state = turns.state
    groups = len(state.done) // turns.repeat
    pending: list[GroupRequest] = []
    together = getattr(generation, "generate_groups_async", None)

    def submit(wanted: list[tuple[int, int]]) -> None:
        """The turns ``(group, turn)`` that still have samples going, in one call where the backend can."""
        asked = []
        for group, turn in wanted:
            rows = range(group * turns.repeat, (group + 1) * turns.repeat)
            active = [i for i in rows if not state.done[i]]
            if active and turn < turns.max_turns:
                asked.append((group, turn, active, turns.request(active, turn)))
        if together is not None and asked:
            handles = together([batch for *_, batch in asked], greedy=greedy)
        else:
            handles = [generation.generate_async(batch, greedy=greedy) for *_, batch in asked]
        pending.extend(GroupRequest(h, g, t, a, b) for h, (g, t, a, b) in zip(handles, asked))

    start = time.perf_counter()
    submit([(group, 0) for group in range(groups)])
    last = start
    while pending:
        done = [first_done(generation, [request.handle for request in pending])]
        if together is not None:  # the others done by now too: their next turns go in one call
            taken = {done[0][0]}
            rest = [i for i in range(len(pending)) if i not in taken]
            done += [(rest[i], out) for i, out in ready_now(generation, [pending[j].handle for j in rest])]
        last = time.perf_counter()
        requests = [(pending[index], out) for index, out in done]
        for index in sorted((index for index, _ in done), reverse=True):
            pending.pop(index)
        for request, out in requests:
            turns.take(request.active, request.batch, out)
            turns.score(request.active, request.turn, timer)
        submit([(request.group, request.turn + 1) for request, _ in requests])
    timer.seconds["time/generation_s"] = timer.seconds.get("time/generation_s", 0.0) + last - start
