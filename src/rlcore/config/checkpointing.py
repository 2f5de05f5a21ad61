"""The run's checkpoints (``checkpointing``): how often they are saved and which are kept."""

from __future__ import annotations

import re

from pydantic import Field, PositiveInt, field_validator

from rlcore.config.base import StrictModel

#: NeMo-RL's ``checkpoint_must_save_by`` format: days, hours, minutes, seconds.
DURATION = re.compile(r"^(\d+):(\d+):(\d+):(\d+)$")


def duration_seconds(text: str) -> int:
    """``'DD:HH:MM:SS'`` → seconds (``'00:03:45:00'`` → 13500); ValueError for another form."""
    match = DURATION.match(text.strip())
    if match is None:
        raise ValueError(f"{text!r} is not a duration 'DD:HH:MM:SS' (e.g. '00:03:45:00', 3 hours 45 minutes)")
    days, hours, minutes, seconds = (int(g) for g in match.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


class CheckpointingConfig(StrictModel):
    enabled: bool = Field(True, description="Save checkpoints during the run.")
    save_every_n_steps: PositiveInt = Field(10, description="Save after every N steps (and after the last step).")
    keep_last: PositiveInt = Field(
        2,
        description="How many step checkpoints to keep: the newest, or with "
        "metric_name the best by it (and the newest, to resume from).",
    )
    metric_name: str | None = Field(
        None,
        description="Keep the checkpoints best by this metric of the step's row (e.g. 'validation/accuracy'; "
        "ties: the newer wins) instead of the newest; NeMo-RL's keep_top_k by metric_name.",
    )
    higher_is_better: bool = Field(True, description="With metric_name: whether a larger value is better.")
    checkpoint_must_save_by: str | None = Field(
        None,
        description="A training-time limit 'DD:HH:MM:SS' from the start of training (NeMo-RL's key): at the end of "
        "the first step after which the limit has passed, or the next step (as long as the mean step) would pass "
        "it, a checkpoint is saved and the run stops cleanly, resumable with --resume. None: no limit.",
    )

    @field_validator("checkpoint_must_save_by")
    @classmethod
    def _a_duration(cls, value: str | None) -> str | None:
        if value is not None:
            duration_seconds(value)
        return value
