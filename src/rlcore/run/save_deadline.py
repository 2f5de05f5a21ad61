"""``checkpointing.checkpoint_must_save_by``: save and stop before a wall-clock limit (NeMo-RL's TimeoutChecker).

NeMo-RL's GRPO, SFT, DPO and distillation loops start a clock when training starts and, at the end of every
step, save a checkpoint and stop cleanly the first time the limit has passed or the next step, taking as long
as the mean step so far, would end past it (``fit_last_save_time``). The run is then resumable from that
checkpoint. Without checkpointing the run still stops there, as NeMo-RL's does.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rlcore.config.checkpointing import duration_seconds


class SaveDeadlineReached(BaseException):
    """Raised after the step that was saved because of the deadline: the run stops cleanly there. A
    ``BaseException``, like a signal's stop, so that no loop's ``except Exception`` takes it for a failure."""


class SaveDeadline:
    """The limit of a run's training time; :meth:`step_done` at the end of each step says when to save and stop."""

    def __init__(self, limit: str | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit_s = None if limit is None else duration_seconds(limit)
        self.limit = limit
        self._clock = clock
        self._start = self._previous = clock()
        self._step_times: list[float] = []
        self.reached = False

    def step_done(self) -> bool:
        """Record the step that just ended; True once: when the limit has passed, or the next step (as long as
        the mean step) would end past it."""
        now = self._clock()
        self._step_times.append(now - self._previous)
        self._previous = now
        if self.limit_s is None or self.reached:
            return False
        elapsed = now - self._start
        mean_step = sum(self._step_times) / len(self._step_times)
        self.reached = elapsed + mean_step >= self.limit_s
        return self.reached

    def reached_after(self, step: int) -> SaveDeadlineReached:
        """The stop after ``step``, saying why."""
        return SaveDeadlineReached(
            f"checkpointing.checkpoint_must_save_by={self.limit}: the next step would end past it, so the run "
            f"stopped after step {step}"
        )


__all__ = ["SaveDeadline", "SaveDeadlineReached"]
