"""Moved: building prompts (chat template, length budget) is :mod:`rlcore.run.prompts`."""

from rlcore.run.prompts import (
    PASSTHROUGH_TEMPLATE,
    check_prompt_room,
    clip_rollout,
    configure_tokenizer,
    format_prompts,
)

__all__ = ["PASSTHROUGH_TEMPLATE", "check_prompt_room", "clip_rollout", "configure_tokenizer", "format_prompts"]
