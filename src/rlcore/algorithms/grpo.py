"""Moved: the GRPO loop is :mod:`rlcore.run.grpo`, the run's pieces :mod:`rlcore.run.build` (re-exported here)."""

from rlcore.run.build import Run, build_run
from rlcore.run.grpo import (
    Timer,
    completions_of,
    encode_prompts,
    grpo_step,
    grpo_train,
    training_batch,
)
from rlcore.run.tasks import Task

__all__ = ["Run", "Task", "Timer", "build_run", "completions_of", "encode_prompts", "grpo_step", "grpo_train",
           "training_batch"]
