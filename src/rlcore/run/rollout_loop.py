"""The step loop every rollout algorithm shares (GRPO, distillation, a third party's): one step after another,
validation when due, and an early end when the epochs' data runs out inside a step."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from rlcore.datasets import DataExhausted
from rlcore.run.rollouts import rollout_step
from rlcore.run.validation import synchronous_generate, validate, validation_due

if TYPE_CHECKING:
    from rlcore.run.build import Run


def train_rollout_steps(
    run: Run, one_step: Callable[[int], dict[str, float]], on_step: Callable[[int, dict[str, float]], None]
) -> str | None:
    """Run ``one_step(step)`` for steps ``run.start_step .. run.num_steps - 1``, adding the validation metrics
    when due and calling ``on_step(step, metrics)`` after each. Returns None, or why the run ended early (a step
    drew past the last batch the epochs allow; the steps before it are complete)."""
    for step in range(run.start_step, run.num_steps):
        try:
            with rollout_step(step):  # the step's sampling seeds (rlcore.run.rollouts.sampling_seed)
                metrics = one_step(step)
        except DataExhausted as exc:
            return f"the data ran out during step {step} ({exc})"
        if validation_due(run, step):
            metrics.update(validate(run, synchronous_generate(run)))
        on_step(step, metrics)
    return None
