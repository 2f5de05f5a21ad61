"""The settings every rollout loop shares (GRPO, on-policy distillation, a third party's on the same machinery):
prompts and completions per step, turns, steps and epochs, the validation schedule, the seed. Each algorithm's
section derives from :class:`RolloutLoopConfig` and overrides only the defaults that differ."""

from __future__ import annotations

from typing import Any

from pydantic import Field, NonNegativeInt, PositiveInt

from rlcore.config.base import StrictModel


class RolloutLoopConfig(StrictModel):
    """A loop that samples prompts, generates completions, scores them and trains on them."""

    num_prompts_per_step: PositiveInt = Field(8, description="Prompts sampled per step.")
    num_generations_per_prompt: PositiveInt = Field(4, description="Completions per prompt (the group size).")
    max_num_steps: PositiveInt = Field(20, description="Training steps (each: generate, score, train).")
    seed: int = Field(0, description="Seed of prompt sampling and generation.")
    max_rollout_turns: PositiveInt = Field(
        1,
        description="Turns per rollout: generate, let the environment answer (its observation is appended), "
        "generate again, until the environment says done, this many turns, or policy.max_total_sequence_length. "
        "1 = a single completion. Only generated tokens are trained.",
    )
    max_num_epochs: PositiveInt | None = Field(
        None,
        description="Passes over the training data (data.train.path); the run ends at whichever of this and "
        "max_num_steps comes first. None = only max_num_steps bounds it.",
    )
    val_period: NonNegativeInt = Field(
        0,
        description="Validate every N steps (after the step trains): greedy "
        "completions of the validation samples, scored by the environment; 0 = "
        "never periodically.",
    )
    val_at_start: bool = Field(False, description="Validate the initial weights before the first step.")
    val_at_end: bool = Field(False, description="Validate after the last step (once, if val_period already did).")
    max_val_samples: PositiveInt | None = Field(
        None, description="Validate on the first N samples of data.validation; None = all of them."
    )
    val_batch_size: PositiveInt = Field(32, description="Prompts generated per validation batch.")

    @property
    def prompts_per_generation_batch(self) -> int:
        """Prompts per batch drawn from the data (one batch per step)."""
        return self.num_prompts_per_step

    def draw_settings(self, name: str, cfg: Any) -> dict[str, Any]:
        """How the run draws its samples (:class:`rlcore.datasets.sources.DrawSettings`); ``name``: the section's
        key, for messages."""
        return {
            "batch_size": self.prompts_per_generation_batch,
            "size_setting": f"{name}.num_prompts_per_step",
            "seed": self.seed,
            "max_epochs": self.max_num_epochs,
            "epochs_setting": f"{name}.max_num_epochs",
            "max_val_samples": self.max_val_samples,
        }
