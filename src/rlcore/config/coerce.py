"""Configs given as plain dicts (the seeds' ``TypedDict`` shape) turned into the pydantic models.

``Policy``, the training workers and the loss functions accept either the
model or a dict with the same keys; a dict is validated like a YAML file, and
every problem is one line naming the dotted path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlcore.config.errors import ConfigError
from rlcore.config.policy import PolicyConfig


def as_policy_config(config: Any, *, world_size: int | None = None, use_gpu: bool = False) -> PolicyConfig:
    """``config`` as a validated ``PolicyConfig``.

    A ``PolicyConfig`` is returned as is. A mapping is validated (``policy.<key>: ...`` problem
    lines); given the cluster's ``world_size`` (and whether it has GPUs), the cross-field rules run
    too, as they do for a config file. Anything else is a TypeError.
    """
    if isinstance(config, PolicyConfig):
        return config
    if not isinstance(config, Mapping):
        raise TypeError(f"a policy config is a PolicyConfig or a dict of its keys, got {type(config).__name__}")
    from rlcore.config.loader import validate_section

    model, problems = validate_section(PolicyConfig, dict(config), "policy")
    if model is None:
        raise ConfigError(problems + _nemo_rl_hint(problems))
    if world_size:
        from rlcore.config.cluster import ClusterConfig
        from rlcore.config.rules import check_rules
        from rlcore.config.schemas import RLCoreConfig

        cluster = ClusterConfig(num_nodes=1, workers_per_node=world_size, use_gpu=use_gpu)
        if problems := check_rules(RLCoreConfig(cluster=cluster, policy=model)):
            raise ConfigError(problems)
    return model


def _nemo_rl_hint(problems: list[str]) -> list[str]:
    """A dict straight from a NeMo-RL config (``config["policy"]``) carries keys rlcore's schema lacks."""
    from rlcore.nemo_rl.convert import exact_rule

    unknown = [line.split(":", 1)[0] for line in problems if ": unknown key" in line]
    if any((rule := exact_rule(path)) is not None and rule.action != "map" for path in unknown):
        return ["hint: this is a NeMo-RL policy config; convert it with "
                "rlcore.nemo_rl.policy_config_from_nemo_rl(config), which lists what rlcore ignores or rejects"]
    return []


__all__ = ["as_policy_config"]
