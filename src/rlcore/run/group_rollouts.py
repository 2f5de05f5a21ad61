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


def roll_out_ready_first(turns: GroupTurns, generation: Any, greedy: bool, timer: Timer) -> None:
    """Roll out every group of ``turns``' samples through ``generation``, each group's turns one after another and
    the groups side by side, handling whichever finishes first.

    The phases overlap here, so they measure: ``time/generation_s``, the wall time from the first submission
    until the last group's last output is in (scoring of the groups done earlier falls inside it);
    ``time/environment_s``, the time spent in the environment's calls, summed."""
    state = turns.state
    groups = len(state.done) // turns.repeat
    pending: list[GroupRequest] = []

    def submit(group: int, turn: int) -> None:
        rows = range(group * turns.repeat, (group + 1) * turns.repeat)
        active = [i for i in rows if not state.done[i]]
        if not active or turn >= turns.max_turns:
            return
        batch = turns.request(active, turn)
        pending.append(GroupRequest(generation.generate_async(batch, greedy=greedy), group, turn, active, batch))

    start = time.perf_counter()
    for group in range(groups):
        submit(group, 0)
    last = start
    while pending:
        index, out = first_done(generation, [request.handle for request in pending])
        request = pending.pop(index)
        last = time.perf_counter()
        turns.take(request.active, request.batch, out)
        turns.score(request.active, request.turn, timer)
        submit(request.group, request.turn + 1)
    timer.seconds["time/generation_s"] = timer.seconds.get("time/generation_s", 0.0) + last - start
