"""What the core's rules may read of an algorithm's section: its schedule (:class:`LoopSchedule`).

An algorithm's section is its own model; the core never assumes more of it than this protocol. The sections of
rlcore's loops implement it (:class:`rlcore.config.rollout_loop.RolloutLoopConfig`, its rollout algorithms', and
:class:`rlcore.config.offline_loop.OfflineLoopConfig`, SFT's and DPO's). A section that does not (a third party's
plain ``pydantic.BaseModel``) is not checked by the rules that read it: they skip it, rather than fail on a
missing attribute.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class LoopSchedule(Protocol):
    """How long a loop trains and when it validates, in NeMo-RL's names."""

    max_num_steps: int  # training steps
    max_num_epochs: int | None  # passes over the train data; None: only max_num_steps bounds the run
    seed: int
    val_period: int  # validate every N steps; 0: never periodically
    val_at_start: bool
    val_at_end: bool


def schedule_of(section: object) -> LoopSchedule | None:
    """``section`` as a :class:`LoopSchedule`, or None when it has no such schedule (or there is no section)."""
    return section if isinstance(section, LoopSchedule) else None


__all__ = ["LoopSchedule", "schedule_of"]
