"""Sections of an ``rlcore run``: the GRPO loop, logging and checkpointing (the task: :mod:`rlcore.config.data`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, NonNegativeInt, PositiveInt

from rlcore.config.base import StrictModel


class AsyncGRPOConfig(StrictModel):
    """Generation runs ahead of training on its own resources (NeMo-RL's ``grpo.async_grpo`` spelling).

    The rollout a step trains on may come from weights up to
    ``max_trajectory_age_steps`` training steps older than the ones being
    trained; the loss corrects for it with importance weights against the
    engine's logprobs (``loss.use_importance_sampling_correction``).
    """

    enabled: bool = Field(False, description="Overlap generation of the next rollouts with training (needs "
                          "non-colocated generation and loss.use_importance_sampling_correction).")
    max_trajectory_age_steps: PositiveInt = Field(
        1, description="How many training steps older than the trained weights a rollout's weights may be; "
        "generation runs at most this many rollouts ahead. A rollout that would be older is regenerated.")


#: The advantage estimators whose advantages are per token and need the rollout's logprobs first (Reinforce++).
TOKEN_LEVEL_ESTIMATORS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")


class GRPOConfig(StrictModel):
    """Group Relative Policy Optimization: several completions per prompt, advantages within the group."""

    num_prompts_per_step: PositiveInt = Field(8, description="Prompts sampled per step.")
    num_generations_per_prompt: PositiveInt = Field(4, description="Completions per prompt (the group size).")
    max_num_steps: PositiveInt = Field(20, description="Training steps (each: generate, score, train).")
    advantage_estimator: Literal["leave_one_out", "leave_one_out_std", "mean", "mean_std", "reinforce_plus_plus",
                                 "reinforce_plus_plus_baseline"] = Field(
        "leave_one_out",
        description="leave_one_out: reward minus the mean of the group's other rewards; leave_one_out_std: that, "
        "divided by the others' std + eps where it is > 0 (NeMo-RL's GRPO default); mean: reward minus the "
        "group mean; mean_std: (reward - group mean) / (group std + eps); reinforce_plus_plus: the reward at "
        "every token (minus beta * KL there with loss.use_kl_in_reward), whitened over all tokens of the "
        "batch; reinforce_plus_plus_baseline: the same from reward minus the group mean (NeMo-RL's "
        "minus_baseline).",
    )
    seed: int = Field(0, description="Seed of prompt sampling and generation.")
    max_rollout_turns: PositiveInt = Field(
        1, description="Turns per rollout: generate, let the environment answer (its observation is appended), "
        "generate again, until the environment says done, this many turns, or policy.max_total_sequence_length. "
        "1 = a single completion. Only generated tokens are trained.")
    max_num_epochs: PositiveInt | None = Field(
        None, description="Passes over the training data (data.train.path); the run ends at whichever of this and "
        "max_num_steps comes first. None = only max_num_steps bounds it.")
    val_period: NonNegativeInt = Field(0, description="Validate every N steps (after the step trains); 0 = never "
                                       "periodically.")
    val_at_start: bool = Field(False, description="Validate the initial weights before the first step.")
    val_at_end: bool = Field(False, description="Validate after the last step (once, if val_period already did).")
    max_val_samples: PositiveInt | None = Field(None, description="Validate on the first N samples of "
                                                "data.validation; None = all of them.")
    val_batch_size: PositiveInt = Field(32, description="Prompts generated per validation batch.")
    async_grpo: AsyncGRPOConfig = Field(default_factory=AsyncGRPOConfig,
                                        description="Asynchronous GRPO: generation runs ahead of training.")


class LoggerConfig(StrictModel):
    output_dir: str = Field("runs/latest", description="Directory for metrics.jsonl, plots, TensorBoard, checkpoints.")
    tensorboard: bool = Field(True, description="Also write TensorBoard events when tensorboard is installed.")
    progress_bar: bool = Field(True, description="Show a progress bar per step.")


class CheckpointingConfig(StrictModel):
    enabled: bool = Field(True, description="Save checkpoints during the run.")
    save_every_n_steps: PositiveInt = Field(10, description="Save after every N steps (and after the last step).")
    keep_last: PositiveInt = Field(2, description="How many step checkpoints to keep: the newest, or with "
                                   "metric_name the best by it (and the newest, to resume from).")
    metric_name: str | None = Field(
        None, description="Keep the checkpoints best by this metric of the step's row (e.g. 'validation/accuracy'; "
        "ties: the newer wins) instead of the newest; NeMo-RL's keep_top_k by metric_name.")
    higher_is_better: bool = Field(True, description="With metric_name: whether a larger value is better.")
