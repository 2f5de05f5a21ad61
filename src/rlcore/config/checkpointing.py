"""The run's checkpoints (``checkpointing``): how often they are saved and which are kept."""

from __future__ import annotations

from pydantic import Field, PositiveInt

from rlcore.config.base import StrictModel


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
