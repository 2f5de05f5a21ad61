"""rlcore configuration: pydantic schemas, YAML loading, dotted overrides, rules.

Typical use::

    from rlcore.config import load_config, resolve, ConfigError
    cfg = load_config("examples/dtensor_tiny.yaml", ["policy.train_micro_batch_size=2"])
    cfg.policy.training_backend, cfg.world_size
    resolved = resolve(cfg)              # against the installed backends: layout, batch plan, sections
    resolved.policy.data_parallel_size

Importing this package never imports torch or ray. The algorithms' sections live in their packages
(``rlcore.algorithms.<name>.config``); the names ``GRPOConfig``, ``SFTConfig``, ``DPOConfig``,
``DistillationConfig`` and ``ClippedPGLossConfig`` are still importable from here, looked up through the registry
(the config layer never imports an algorithm).
"""

from typing import Any

from rlcore.config.batch_plan import BatchPlan, batch_problems
from rlcore.config.coerce import as_policy_config
from rlcore.config.errors import ConfigError
from rlcore.config.loader import dump_config, load_config, load_config_dict, validate_section
from rlcore.config.overrides import apply_overrides
from rlcore.config.resolve import ResolvedConfig, ResolvedGeneration, ResolvedPolicy, resolve, resolve_policy
from rlcore.config.rules import RULES, check_rules, rule
from rlcore.config.schemas import (
    ClusterConfig,
    ColocationConfig,
    ColocationResources,
    DynamicBatchingConfig,
    GenerationConfig,
    PolicyConfig,
    Precision,
    PytorchOptimizerConfig,
    RLCoreConfig,
    SchedulerMilestones,
    SectionsModel,
    SequencePackingConfig,
    SinglePytorchSchedulerConfig,
    StrictModel,
    TokenizerConfig,
    config_json_schema,
)

__all__ = [
    "RULES",
    "BatchPlan",
    "ClusterConfig",
    "ColocationConfig",
    "ColocationResources",
    "ConfigError",
    "DPOConfig",
    "DistillationConfig",
    "DynamicBatchingConfig",
    "GenerationConfig",
    "PolicyConfig",
    "Precision",
    "PytorchOptimizerConfig",
    "RLCoreConfig",
    "ResolvedConfig",
    "ResolvedGeneration",
    "ResolvedPolicy",
    "SFTConfig",
    "SchedulerMilestones",
    "SectionsModel",
    "SequencePackingConfig",
    "SinglePytorchSchedulerConfig",
    "StrictModel",
    "TokenizerConfig",
    "apply_overrides",
    "as_policy_config",
    "batch_problems",
    "check_rules",
    "config_json_schema",
    "dump_config",
    "load_config",
    "load_config_dict",
    "resolve",
    "resolve_policy",
    "rule",
    "validate_section",
]

#: Names this package exported before the algorithms' sections moved: ``name: (algorithm, owned section key)``.
_ALGORITHM_CLASSES = {
    "GRPOConfig": ("grpo", None),
    "SFTConfig": ("sft", None),
    "DPOConfig": ("dpo", None),
    "DistillationConfig": ("distillation", None),
    "ClippedPGLossConfig": ("grpo", "loss"),
}


def __getattr__(name: str) -> Any:
    """An algorithm's config class by its old name here, through the registry (see the module docstring)."""
    if name not in _ALGORITHM_CLASSES:
        raise AttributeError(f"module 'rlcore.config' has no attribute {name!r}")
    from rlcore.config.schemas import registered_algorithms

    algorithm, key = _ALGORITHM_CLASSES[name]
    spec = registered_algorithms()[algorithm]
    return spec.load_config_class() if key is None else spec.load_section_class(key)
