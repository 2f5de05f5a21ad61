"""The SFT loop's section (``sft``): NLL on the assistant tokens of chat samples, NeMo-RL's ``sft`` names.

A config with an ``sft`` section is an SFT run: ``rlcore run`` trains
``policy.train_global_batch_size`` samples per step with
:class:`rlcore.algorithms.sft.loss.NLLLoss` and validates with the same
loss in eval mode. It generates nothing and scores nothing, so the GRPO-only
sections (``grpo``, ``loss``, ``env``, ``policy.generation``) are refused
rather than ignored (the spec's ``unread_sections``, checked by :mod:`rlcore.config.rules`).
"""

from __future__ import annotations

from pydantic import Field, PositiveInt

from rlcore.config.offline_loop import OfflineLoopConfig


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
