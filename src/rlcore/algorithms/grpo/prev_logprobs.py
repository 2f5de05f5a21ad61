"""The loss's automatic setting ``loss.force_on_policy_ratio``: whether GRPO's step skips its prev-logprob pass,
decided once when a run's config is resolved (:meth:`rlcore.algorithms.grpo.loop.GRPO.resolve`). Light: no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlcore.config.policy import PolicyConfig
    from rlcore.config.schemas import RLCoreConfig


def rollout_trained_in_one_step(cfg: RLCoreConfig) -> bool:
    """Whether each step's rollout is exactly one global batch, i.e. one optimizer step."""
    g = cfg.grpo
    return g.num_prompts_per_step * g.num_generations_per_prompt == cfg.policy.train_global_batch_size


def model_dropout(model_dir: str) -> dict[str, float]:
    """The dropout probabilities above 0 in the model's Hugging Face ``config.json`` (``attention_dropout``, ...):
    a directory's, or a hub id's in the hub cache (:func:`rlcore.models.config_json.read_config_json`)."""
    from rlcore.models.config_json import read_config_json

    config = read_config_json(model_dir) or {}
    return {
        key: value
        for key, value in config.items()
        if ("dropout" in key or "pdrop" in key) and isinstance(value, (int, float)) and value > 0
    }


def skips_prev_logprob_pass(cfg: RLCoreConfig, policy: PolicyConfig | None = None) -> bool:
    """Whether the loss uses the current logprobs as ``prev_logprobs`` instead of a separate pass.

    ``loss.force_on_policy_ratio`` null (automatic) means: when the rollout is trained in one
    optimizer step (and ``loss.use_kl_in_reward`` does not need the logprobs before training, and the loss is
    not CISPO, which NeMo-RL refuses with a forced ratio).
    Then every micro-batch's forward runs on the parameters that sampled the rollout (gradients
    accumulate, nothing is updated before the step), so the separate pass would compute the same
    logprobs again — unless the model has dropout: the training forward
    runs in train mode, the logprob pass in eval mode. true / false decide it outright.
    ``policy``: the policy config with its model as a local path (default ``cfg.policy``).
    """
    forced = cfg.loss.force_on_policy_ratio
    if forced is not None:
        return forced
    if cfg.loss.use_kl_in_reward:  # the reward's KL needs the logprobs before training starts
        return False
    if cfg.loss.use_cispo:  # NeMo-RL refuses CISPO with a forced ratio, and so does loss.force_on_policy_ratio
        return False
    model = (policy or cfg.policy).model_name
    return rollout_trained_in_one_step(cfg) and not model_dropout(model)
