"""The DPO loop's section (``dpo``): preference pairs against a frozen reference policy, NeMo-RL's ``dpo`` names.

A config with a ``dpo`` section is a DPO run: each step trains
``policy.train_global_batch_size`` pairs (twice as many sequences, chosen and
rejected interleaved) with :class:`rlcore.algorithms.dpo.loss.DPOLossFn`,
whose settings are the loss fields below. Like SFT it generates and scores
nothing, so the GRPO-only sections are refused (:mod:`rlcore.config.rules`).
"""

from __future__ import annotations

from pydantic import Field, PositiveInt

from rlcore.config.base import StrictModel
from rlcore.config.offline_loop import OfflineLoopConfig


class DPOLossConfig(StrictModel):
    """The loss's settings (:class:`rlcore.algorithms.dpo.loss.DPOLossFn`), NeMo-RL's names and defaults."""

    reference_policy_kl_penalty: float = Field(
        0.05,
        ge=0.0,
        description="beta: scales the log-ratio margin inside the sigmoid (the KL strength); 0 makes "
        "the preference term the constant log 2 with no gradient, so only the SFT term trains (as in NeMo-RL).",
    )
    preference_loss_weight: float = Field(1.0, ge=0.0, description="Weight of the preference (DPO) term.")
    sft_loss_weight: float = Field(0.0, ge=0.0, description="Weight of the NLL term on the chosen responses.")
    preference_average_log_probs: bool = Field(
        False, description="A response's reward is the mean, not the sum, of its token log-ratios."
    )
    sft_average_log_probs: bool = Field(
        False, description="A chosen response's NLL is the mean, not the sum, over its tokens."
    )


class DPOConfig(OfflineLoopConfig, DPOLossConfig):
    """Direct Preference Optimization on (prompt, chosen, rejected) samples."""

    max_num_steps: PositiveInt = Field(
        150, description="Training steps (each: policy.train_global_batch_size pairs, one optimizer step)."
    )
    val_global_batch_size: PositiveInt = Field(
        8, description="Pairs per validation batch (the last one is padded with masked pairs)."
    )
    reference_batches_per_swap: PositiveInt = Field(
        8,
        description="Training batches whose reference-policy logprobs are computed together, with one swap of "
        "the reference weights in and out (1: every step swaps, as before). rlcore's own setting; NeMo-RL computes "
        "them once per batch.",
    )
    add_generation_prompt: bool = Field(
        True,
        description="Render the prompt's last user message with the chat template's generation prompt, so "
        "the assistant header is context and only the response is scored.",
    )

    def loss_settings(self) -> DPOLossConfig:
        """The loss's settings alone."""
        return DPOLossConfig(**{k: getattr(self, k) for k in DPOLossConfig.model_fields})
