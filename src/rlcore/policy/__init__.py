"""The ``Policy`` facade."""

from rlcore.policy.lm_policy import Policy

__all__ = ["Policy"]
