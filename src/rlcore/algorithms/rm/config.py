"""The reward-model loop's section (``rm``): Bradley-Terry training on preference pairs, NeMo-RL's ``rm`` names.

A config with an ``rm`` section trains the policy as a reward model: a value model (the language model's trunk and
a scalar ``score`` head, built with ``model_head="value"``) whose score at a sequence's last token is its reward,
trained on (prompt, chosen, rejected) samples with :class:`rlcore.algorithms.rm.loss.BradleyTerryLossFn`. Like DPO
it generates and scores nothing; unlike DPO it keeps no reference model.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, PositiveInt, field_validator, model_validator

from rlcore.config.offline_loop import OfflineLoopConfig

#: What ``rm.max_num_steps: -1`` (NeMo-RL's default) is stored as: no step bound, the epochs end the run.
UNTIL_EPOCHS_END = 2**31 - 1


class RMConfig(OfflineLoopConfig):
    """Bradley-Terry reward-model training on (prompt, chosen, rejected) samples."""

    max_num_steps: PositiveInt = Field(
        -1,
        validate_default=True,
        description="Training steps (each: policy.train_global_batch_size pairs, one optimizer step); -1 (NeMo-RL's "
        f"default, stored as {UNTIL_EPOCHS_END}) = every batch of max_num_epochs epochs.",
    )
    val_period: int = Field(16, ge=0, description="Validate every N steps (after the step trains); 0 = never.")
    val_global_batch_size: PositiveInt = Field(
        32, description="Pairs per validation batch (the last one is padded with masked pairs)."
    )
    seed: int = Field(42, description="Seed of the sample order (data.shuffle).")
    add_generation_prompt: bool = Field(
        False,
        description="Render the prompt's last user message with the chat template's generation prompt (NeMo-RL's "
        "reward-model data does not).",
    )

    @field_validator("max_num_steps", mode="before")
    @classmethod
    def _one_epoch(cls, value: Any) -> Any:
        return UNTIL_EPOCHS_END if value == -1 and not isinstance(value, bool) else value

    @model_validator(mode="after")
    def _bounded(self) -> RMConfig:
        if self.max_num_steps == UNTIL_EPOCHS_END and self.max_num_epochs is None:
            raise ValueError(
                "rm.max_num_steps: -1 trains until max_num_epochs end, but rm.max_num_epochs is None; give a "
                "number of steps or of epochs"
            )
        return self
