"""The root config model and every section model, in one import place.

Adding a top-level section is one line in ``RLCoreConfig`` (plus, if it has
cross-field rules, one function registered in ``rlcore.config.rules``).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from rlcore.config.base import SectionsModel, StrictModel
from rlcore.config.cluster import ClusterConfig
from rlcore.config.data import DataConfig, DatasetConfig, EnvConfig, legacy_task_sections
from rlcore.config.grpo import CheckpointingConfig, GRPOConfig, LoggerConfig
from rlcore.config.generation import ColocationConfig, ColocationResources, GenerationConfig
from rlcore.config.distillation import DistillationConfig
from rlcore.config.dpo import DPOConfig
from rlcore.config.loss import ClippedPGLossConfig
from rlcore.config.sft import SFTConfig
from rlcore.config.policy import (
    DTensorConfig,
    DynamicBatchingConfig,
    MegatronConfig,
    MegatronDDPConfig,
    MegatronOptimizerConfig,
    MegatronSchedulerConfig,
    PolicyConfig,
    Precision,
    PytorchOptimizerConfig,
    SchedulerMilestones,
    SequencePackingConfig,
    SinglePytorchSchedulerConfig,
    TokenizerConfig,
)


#: The algorithm sections other than ``grpo`` (the default); a config has at most one.
ALGORITHMS = ("sft", "dpo", "distillation")


class RLCoreConfig(StrictModel):
    """A whole rlcore run: where it runs and what it trains."""

    cluster: ClusterConfig = Field(default_factory=ClusterConfig, description="Workers and the Ray cluster.")
    policy: PolicyConfig = Field(default_factory=PolicyConfig, description="The policy and its training backend.")
    grpo: GRPOConfig | None = Field(
        None, description="The GRPO loop of 'rlcore run' (which fills in the defaults when it is absent); "
        "configs that only build a Policy leave it out.")
    sft: SFTConfig | None = Field(
        None, description="Supervised fine-tuning instead of GRPO: with this section 'rlcore run' trains NLL on the "
        "assistant tokens of data.train (and refuses the GRPO-only sections).")
    dpo: DPOConfig | None = Field(
        None, description="Direct Preference Optimization instead of GRPO: with this section 'rlcore run' trains "
        "on the (prompt, chosen, rejected) pairs of data.train against the frozen initial weights.")
    distillation: DistillationConfig | None = Field(
        None, description="On-policy distillation instead of GRPO: with this section 'rlcore run' trains the "
        "student on the KL to a frozen teacher's top-k logits over the student's own rollouts.")
    loss: ClippedPGLossConfig = Field(default_factory=ClippedPGLossConfig, description="The policy-gradient loss.")
    data: DataConfig = Field(default_factory=DataConfig, description="The samples: train and validation splits, "
                             "and how a row becomes a prompt.")
    env: EnvConfig = Field(default_factory=EnvConfig, description="The environment that scores completions.")
    logger: LoggerConfig = Field(default_factory=LoggerConfig, description="Metrics, plots and progress output.")
    checkpointing: CheckpointingConfig = Field(default_factory=CheckpointingConfig, description="Checkpoints.")

    @model_validator(mode="before")
    @classmethod
    def _legacy_task(cls, data: Any) -> Any:
        """rlcore 0.1's ``task`` section (two functions) still loads, as ``data`` and ``env``, with a warning."""
        if isinstance(data, dict) and "task" in data:
            data = dict(data)
            data.update(legacy_task_sections(data.pop("task"), given=[k for k in ("data", "env") if k in data]))
        return data

    @property
    def algorithm(self) -> str:
        """What ``rlcore run`` trains: ``'sft'``, ``'dpo'`` or ``'distillation'`` with that section, else
        ``'grpo'`` (a config with two is refused by :mod:`rlcore.config.rules`)."""
        return next((name for name in ALGORITHMS if getattr(self, name) is not None), "grpo")

    @property
    def algorithm_section(self) -> Any:
        """The section of the algorithm ``rlcore run`` trains (``sft``, ``dpo``, ``distillation`` or ``grpo``); they
        name their seed, steps, epochs and validation schedule alike (NeMo-RL's names)."""
        return getattr(self, self.algorithm)

    @property
    def world_size(self) -> int:
        """Training ranks: ``cluster.num_nodes * cluster.workers_per_node`` (the data-parallel size follows
        from the training backend's layout: :func:`rlcore.config.resolve`)."""
        return self.cluster.world_size


def config_json_schema() -> dict[str, Any]:
    """JSON schema (draft 2020-12) of ``RLCoreConfig`` as accepted on input."""
    return RLCoreConfig.model_json_schema(mode="validation")


__all__ = [
    "CheckpointingConfig",
    "ClippedPGLossConfig",
    "GRPOConfig",
    "LoggerConfig",
    "DataConfig",
    "DatasetConfig",
    "EnvConfig",
    "ClusterConfig",
    "ColocationConfig",
    "ColocationResources",
    "DTensorConfig",
    "DynamicBatchingConfig",
    "GenerationConfig",
    "MegatronConfig",
    "MegatronDDPConfig",
    "MegatronOptimizerConfig",
    "MegatronSchedulerConfig",
    "PolicyConfig",
    "Precision",
    "PytorchOptimizerConfig",
    "DPOConfig",
    "DistillationConfig",
    "RLCoreConfig",
    "SFTConfig",
    "SchedulerMilestones",
    "SectionsModel",
    "SequencePackingConfig",
    "SinglePytorchSchedulerConfig",
    "StrictModel",
    "TokenizerConfig",
    "config_json_schema",
]
