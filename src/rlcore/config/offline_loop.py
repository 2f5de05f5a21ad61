"""The settings every loop over data as written shares (SFT, DPO, a third party's on the same machinery): epochs,
the validation schedule, the seed and how a message log becomes tokens. Each such algorithm's section derives from
:class:`OfflineLoopConfig`, as rollout algorithms derive from :class:`rlcore.config.rollout_loop.RolloutLoopConfig`."""

from __future__ import annotations

from typing import Any

from pydantic import Field, NonNegativeInt, PositiveInt

from rlcore.config.base import StrictModel


class OfflineLoopConfig(StrictModel):
    """What SFT and DPO share: a loop over data as written (NeMo-RL's names), validated in eval-mode batches, and
    how a message log becomes tokens."""

    max_num_epochs: PositiveInt | None = Field(
        1,
        description="Passes over data.train; the run ends at whichever of this and max_num_steps comes first. "
        "None = only max_num_steps bounds it.",
    )
    val_period: NonNegativeInt = Field(
        0, description="Validate every N steps (after the step trains); 0 = never periodically."
    )
    val_batches: NonNegativeInt = Field(
        0, description="Validation batches per validation; 0 = every sample of the validation data."
    )
    val_micro_batch_size: PositiveInt = Field(
        1, description="Samples (DPO: pairs) per validation forward pass on each rank."
    )
    val_at_start: bool = Field(False, description="Validate the initial weights before the first step.")
    val_at_end: bool = Field(False, description="Validate after the last step (once, if val_period already did).")
    seed: int = Field(0, description="Seed of the sample order (data.shuffle).")
    add_bos: bool = Field(
        True,
        description="Start every sample with the tokenizer's BOS token (when it has one "
        "and the chat template did not write it); NeMo-RL's data.add_bos.",
    )
    add_eos: bool = Field(
        True,
        description="End every sample with the tokenizer's EOS token, trained when the "
        "last message is a trained one, so the model learns to stop; NeMo-RL's data.add_eos.",
    )

    def draw_settings(self, name: str, cfg: Any) -> dict[str, Any]:
        """How the run draws its samples (:class:`rlcore.datasets.sources.DrawSettings`): one global batch of
        ``policy.train_global_batch_size`` a step; validation capped at ``val_batches`` batches."""
        val_size = getattr(self, "val_global_batch_size", 0)
        return {
            "batch_size": cfg.policy.train_global_batch_size,
            "size_setting": "policy.train_global_batch_size",
            "seed": self.seed,
            "max_epochs": self.max_num_epochs,
            "epochs_setting": f"{name}.max_num_epochs",
            "max_val_samples": self.val_batches * val_size if self.val_batches else None,
        }
