"""The ``reward_model`` environment's section, ``env.reward_model_cfg`` (light: validating it starts nothing).

The reward model is a value-head :class:`rlcore.policy.Policy` of its own settings: :meth:`RewardModelConfig.policy`
builds its policy dict (the section's ``policy`` keys, then the model, precision, window and batch size the section
names), and validation resolves that dict with :func:`rlcore.config.resolve_policy` for the section's own
``resources``, so a backend, layout or batch problem is one line naming its ``env.reward_model_cfg`` path before any
process starts.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, PositiveInt, ValidationInfo, field_validator, model_validator

from rlcore.config.base import StrictModel
from rlcore.config.policy import Precision

SECTION = "env.reward_model_cfg"

#: Policy keys the section sets itself (or that a scorer has no use for), and the fix.
NOT_POLICY_KEYS = {
    "model_name": f"set {SECTION}.model_name",
    "precision": f"set {SECTION}.precision",
    "max_total_sequence_length": f"set {SECTION}.max_model_len",
    "train_micro_batch_size": f"set {SECTION}.batch_size",
    "train_global_batch_size": f"set {SECTION}.batch_size",
    "logprob_batch_size": f"set {SECTION}.batch_size",
    "generation": "the reward model does not generate; remove it",
    "optimizer": "the reward model does not train; remove it",
    "scheduler": "the reward model does not train; remove it",
    "learning_rate": "the reward model does not train; remove it",
    "lora": "the reward model does not train; remove it",
}
#: Policy switches a scorer refuses when on: it scores padded batches of ``batch_size`` rows (NeMo-RL refuses them).
OFF_ONLY = ("dynamic_batching", "sequence_packing")


class RewardModelResources(StrictModel):
    """The reward model's own Ray workers: a placement group beside the run's, never the policy's bundles."""

    num_nodes: PositiveInt = Field(1, description="Nodes of the reward model's workers.")
    workers_per_node: PositiveInt = Field(
        1, description="Reward-model workers (ranks) per node (one per GPU in GPU mode, NeMo-RL's gpus_per_node)."
    )
    use_gpu: bool | None = Field(
        None,
        description="One CUDA device per worker; null: when the run's Ray cluster has GPUs (NeMo-RL's reward model "
        "always takes GPUs), CPU ranks with gloo otherwise.",
    )
    num_cpus_per_worker: float = Field(1.0, gt=0, description="Ray CPUs reserved per worker (fractions allowed).")

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.workers_per_node


class RewardModelConfig(StrictModel):
    """A reward model scoring each rollout's conversation: the head's score at its last token is the reward."""

    model_name: str = Field(
        description="The reward model: a directory or built-in name of a one-label sequence-classification model "
        "(a Hugging Face reward model), a one-label token-classification model (what an rm run saves), or a "
        "causal LM (its trunk, with checkpoint_path giving the head)."
    )
    checkpoint_path: str | None = Field(
        None,
        description="Weights loaded over model_name's: an rm run's checkpoint weights/ directory, or any "
        "one-label sequence- or token-classification model directory of model_name's architecture; null: "
        "model_name's own weights.",
    )
    batch_size: PositiveInt = Field(
        8, description="Conversations per forward pass on each reward-model worker (NeMo-RL's batch_size)."
    )
    max_model_len: PositiveInt = Field(
        4096,
        description="Longest conversation (prompt + completion, with the chat template's and BOS/EOS tokens) the "
        "reward model scores; a longer one is not scored (reward 0, counted in env/errors).",
    )
    precision: Precision = Field("float32", description="The reward model's compute dtype.")
    resources: RewardModelResources = Field(
        default_factory=RewardModelResources, description="The reward model's own workers."
    )
    policy: dict[str, Any] = Field(
        default_factory=dict,
        description="The reward model's other policy settings, each a policy key (e.g. {backend: dtensor, "
        "dtensor_cfg: {tensor_parallel_size: 2}, tokenizer: {name: ..., chat_template: default}}); its backend must "
        "declare value_head (dtensor, megatron). The conversation goes through this tokenizer and its chat "
        "template (tokenizer.chat_template as the policy's: null is the passthrough, 'default' the tokenizer's own); "
        "not the keys this section sets itself, nor training or generation settings.",
    )

    @field_validator("policy")
    @classmethod
    def _scoring_keys_only(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key, fix in NOT_POLICY_KEYS.items():
            if key in value:
                raise ValueError(f"{key} is not one of the reward model's policy keys: {fix}")
        for key in OFF_ONLY:
            section = value.get(key)
            if isinstance(section, dict) and section.get("enabled"):
                raise ValueError(
                    f"{key}.enabled: is true; the reward model scores padded batches of batch_size conversations "
                    "(as NeMo-RL's reward-model environment, which refuses it too): set it to false or remove it"
                )
        return value

    @model_validator(mode="after")
    def _resolves(self, info: ValidationInfo) -> RewardModelConfig:
        """The reward model's policy resolves for its resources (backend, layout, batch plan), and the environment
        runs in the driver: a problem is a :class:`~rlcore.config.ConfigError` of full dotted paths."""
        from rlcore.config import ConfigError
        from rlcore.config.resolve import resolve_policy
        from rlcore.policy.lm_policy import value_head_problem

        owner = (info.context or {}).get("owner")
        workers = getattr(owner, "num_workers", 0)
        problems = []
        if workers:
            problems.append(
                f"env.num_workers: is {workers}; the reward model runs in Ray workers of its own "
                f"({SECTION}.resources), so the environment that drives it stays in the driver: set it to 0"
            )
        try:
            resolved = resolve_policy(
                self.policy_dict(), world_size=self.resources.world_size, use_gpu=bool(self.resources.use_gpu)
            )
        except ConfigError as exc:
            problems += [renamed_problem(line) for line in exc.problems]
        else:
            if problem := value_head_problem(resolved.spec.name, resolved.spec.capabilities, "value"):
                problems.append(f"{SECTION}.policy.backend: {problem}")
        if problems:
            raise ConfigError(problems)  # not a ValueError: pydantic hands it on as it is, each line its own path
        return self

    def policy_dict(self) -> dict[str, Any]:
        """The reward model's policy settings: :attr:`policy` with the model, precision, window (one more position
        than ``max_model_len``: the score's, see :func:`rlcore.algorithms.rm.batches.with_score_position`) and batch
        sizes of the section, no generation."""
        sizes = {
            "train_micro_batch_size": self.batch_size,
            "logprob_batch_size": self.batch_size,
            "train_global_batch_size": self.batch_size * self.resources.world_size,
        }
        return {
            **self.policy,
            **sizes,
            "model_name": self.model_name,
            "precision": self.precision,
            "max_total_sequence_length": self.max_model_len + 1,
            "generation": None,
        }


#: Policy paths the section names by its own keys.
_OWN_PATHS = {
    "policy.model_name": f"{SECTION}.model_name",
    "policy.precision": f"{SECTION}.precision",
    "policy.max_total_sequence_length": f"{SECTION}.max_model_len",
    "policy.train_micro_batch_size": f"{SECTION}.batch_size",
    "policy.train_global_batch_size": f"{SECTION}.batch_size",
    "policy.logprob_batch_size": f"{SECTION}.batch_size",
}


def renamed_problem(line: str) -> str:
    """A problem of the reward model's policy (``policy.<key>: ...``) named where it is fixed; the world it speaks
    of is the section's ``resources``, not the run's ``cluster``."""
    for key in ("num_nodes", "workers_per_node", "use_gpu"):
        line = line.replace(f"cluster.{key}", f"{SECTION}.resources.{key}")
    for path, own in _OWN_PATHS.items():
        if line.startswith(path + ":") or line.startswith(path + "."):
            return own + line[len(path) :]
    if line.startswith("policy."):
        return f"{SECTION}.policy." + line[len("policy.") :]
    return line if line.startswith(SECTION) else f"{SECTION}: {line}"


__all__ = ["NOT_POLICY_KEYS", "SECTION", "RewardModelConfig", "RewardModelResources", "renamed_problem"]
