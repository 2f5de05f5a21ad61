"""Moved: the default task of ``rlcore run`` is :mod:`rlcore.run.tasks.toy` (configs naming this path still work)."""

from rlcore.run.tasks.toy import digit_prompts, digit_reward

__all__ = ["digit_prompts", "digit_reward"]
