"""Configs given as plain dicts (the seeds' ``TypedDict`` shape) turned into the pydantic models.

``Policy``, the training workers and the loss functions accept either the
model or a dict with the same keys; a dict is validated like a YAML file, and
every problem is one line naming the dotted path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlcore.config.errors import ConfigError
from rlcore.config.loader import validate_section
from rlcore.config.policy import PolicyConfig


def as_policy_config(config: Any) -> PolicyConfig:
    """``config`` as a validated ``PolicyConfig``: a ``PolicyConfig`` as is, a mapping validated
    (``policy.<key>: ...`` problem lines), anything else a TypeError.

    The cross-field rules need the cluster: :func:`rlcore.config.resolve_policy` runs them.
    """
    if isinstance(config, PolicyConfig):
        return config
    if not isinstance(config, Mapping):
        raise TypeError(f"a policy config is a PolicyConfig or a dict of its keys, got {type(config).__name__}")
    model, problems = validate_section(PolicyConfig, dict(config), "policy")
    if model is None:
        raise ConfigError(problems)
    return model


__all__ = ["as_policy_config"]
