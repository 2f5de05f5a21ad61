"""The SFT loop's section (``sft``): NLL on the assistant tokens of chat samples, NeMo-RL's ``sft`` names.

A config with an ``sft`` section is an SFT run: ``rlcore run`` trains
``policy.train_global_batch_size`` samples per step with
:class:`rlcore.algorithms.loss_functions.NLLLoss` and validates with the same
loss in eval mode. It generates nothing and scores nothing, so the GRPO-only
sections (``grpo``, ``loss``, ``env``, ``policy.generation``) are refused
rather than ignored (:mod:`rlcore.config.rules`).
"""

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


class SFTConfig(OfflineLoopConfig):
    """Supervised fine-tuning on message logs: the loss falls on assistant tokens only."""

    max_num_steps: PositiveInt = Field(
        60,
        description="Training steps (each: one global batch of "
        "policy.train_global_batch_size samples, one optimizer step).",
    )
    val_global_batch_size: PositiveInt = Field(
        32, description="Samples per validation batch (the last one is padded with masked rows)."
    )
    only_unmask_final: bool = Field(
        False,
        description="Train only on the last assistant message of each sample (earlier assistant turns are context).",
    )
    add_generation_prompt: bool = Field(
        False,
        description="Render each user message with the chat template's generation prompt (the assistant "
        "header then belongs to the context, not the trained tokens); NeMo-RL's data.add_generation_prompt.",
    )
