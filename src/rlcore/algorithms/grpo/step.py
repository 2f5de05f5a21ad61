"""GRPO's part of a step, shared by the synchronous loop (:mod:`rlcore.algorithms.grpo.loop`) and the
asynchronous one (:mod:`rlcore.algorithms.grpo.async_loop`): advantages (group, GDPO, Reinforce++), the loss's
inputs and the training call."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlcore.algorithms.grpo.off_policy import ENGINE_GAP_METRICS, PEARSON_MOMENTS, PEARSON_NAME, probs_pearson
from rlcore.algorithms.toolkit import Timer, moe_metrics, train_step, training_batch

if TYPE_CHECKING:
    from rlcore.interfaces.run import RunContext


def token_advantages(cfg: Any, data: Any, rewards: Any) -> Any:
    """Reinforce++'s per-token advantages, from the rewards and (KL in the reward) the logprob passes."""
    from rlcore.algorithms.grpo.advantages import reinforce_plus_plus_advantages
    from rlcore.algorithms.utils import kl_estimate

    loss = cfg.loss
    kl = None
    if loss.use_kl_in_reward:
        kl = kl_estimate(
            data["reference_policy_logprobs"] - data["prev_logprobs"],
            loss.reference_policy_kl_type,
            loss.kl_input_clamp_value,
            loss.kl_output_clamp_value,
        )
    mask = data["token_mask"] * data["sample_mask"][:, None]
    return reinforce_plus_plus_advantages(
        rewards,
        cfg.grpo.num_generations_per_prompt,
        mask,
        cfg.grpo.advantage_estimator == "reinforce_plus_plus_baseline",
        kl,
        loss.reference_policy_kl_penalty,
    )


def reward_components(data: Any) -> dict[str, Any]:
    """The rollout's named reward components (its ``reward/<name>`` keys), ``{name: [B]}``."""
    return {key.removeprefix("reward/"): value for key, value in data.items() if key.startswith("reward/")}


def gdpo_step_advantages(cfg: Any, components: dict[str, Any]) -> Any:
    """GDPO's advantages from the rollout's reward components, each scaled like the rewards
    (``grpo.reward_scaling``, as NeMo-RL does); a run whose environment returns too few components, or another
    count than ``grpo.gdpo.reward_weights``, stops here at its first step, naming the environment."""
    from rlcore.algorithms.grpo.advantages import gdpo_advantages
    from rlcore.algorithms.grpo.reward_transforms import scale_rewards

    g, env, names = cfg.grpo, cfg.env.name, sorted(components)
    if len(names) < 2:
        returned = f"{len(names)} ({', '.join(names)})" if names else "none"
        raise ValueError(
            f"grpo.advantage_estimator: gdpo needs at least 2 named reward components per sample, but "
            f"environment '{env}' returns {returned} (EnvironmentReturn.reward_components); use an "
            "environment that scores several things by name (the python environment: a reward "
            "function returning {name: rewards}), or set grpo.advantage_estimator to leave_one_out_std "
            "or mean_std (GRPO on the total reward)"
        )
    weights = g.gdpo.reward_weights
    if weights is not None and len(weights) != len(names):
        raise ValueError(
            f"grpo.gdpo.reward_weights: has {len(weights)} entries, but environment '{env}' returns "
            f"{len(names)} reward components: {', '.join(names)}; give one weight per component, in "
            "that (alphabetical) order"
        )
    scaled = {name: scale_rewards(values, g.reward_scaling) for name, values in components.items()}
    return gdpo_advantages(
        scaled, g.num_generations_per_prompt, g.gdpo.use_leave_one_out_baseline, g.gdpo.normalize_rewards, weights
    )


def final_advantages(g: Any, data: Any, rollout_data: Any) -> Any:
    """The training batch's per-token ``advantages`` once computed: the tokens of turns flagged as invalid tool
    calls set to ``grpo.invalid_tool_call_advantage`` (when set), then clipped to ``grpo.advantage_clip_low/high``,
    NeMo-RL's order."""
    from rlcore.algorithms.grpo.advantages import override_flagged_tokens
    from rlcore.algorithms.grpo.reward_transforms import clip_advantages

    advantages = data["advantages"]
    flagged = rollout_data.get("invalid_tool_call_mask")
    if g.invalid_tool_call_advantage is not None and flagged is not None:
        advantages = override_flagged_tokens(advantages, flagged, data["token_mask"], g.invalid_tool_call_advantage)
    return clip_advantages(advantages, g.advantage_clip_low, g.advantage_clip_high)


def invalid_tool_call_rate(rollout_data: Any) -> float:
    """The share of the rollout's assistant turns flagged as invalid tool calls (NeMo-RL's
    ``invalid_tool_call_rate``): flagged turns over turns, each counted as a run of generated tokens."""
    from rlcore.algorithms.grpo.advantages import count_spans

    turns = count_spans(rollout_data["token_mask"])
    return count_spans(rollout_data["invalid_tool_call_mask"]) / max(turns, 1)


def add_logprob_inputs(cfg: Any, policy: Any, data: Any, prev_pass: bool) -> None:
    """Add the loss's policy-computed inputs to ``data``: ``prev_logprobs`` (when ``prev_pass``) and
    ``reference_policy_logprobs`` (when the loss has a KL term). Nothing to compute: no lp-inference switch."""
    needs_reference = cfg.loss.reference_policy_kl_penalty > 0
    if not (prev_pass or needs_reference):
        return
    policy.prepare_for_lp_inference()
    if prev_pass:
        data["prev_logprobs"] = policy.get_logprobs(data)["logprobs"]
    if needs_reference:
        data["reference_policy_logprobs"] = policy.get_reference_policy_logprobs(data)["reference_logprobs"]


def train_on_rollout(run: RunContext, loss_fn: Any, rollout: Any, timer: Timer) -> dict[str, float]:
    """Compute group advantages and the loss's inputs from a scored rollout (a
    :class:`rlcore.run.rollouts.Rollout`), train and mark the engines' weights stale
    (:func:`rlcore.algorithms.toolkit.train_step`); returns the step's metrics."""
    import torch

    from rlcore.algorithms.grpo.advantages import group_advantages
    from rlcore.algorithms.grpo.config import TOKEN_LEVEL_ESTIMATORS
    from rlcore.algorithms.grpo.reward_transforms import overlong_sample_mask, transform_rewards

    cfg, policy, g = run.cfg, run.policy, run.cfg.grpo
    truncated = rollout.data["truncated"]
    # NeMo-RL's order: scale, shape; advantages from those; truncated samples out of the loss; clip the advantages
    rewards = transform_rewards(g, rollout.rewards, rollout.data["first_turn_lengths"], truncated).rewards
    per_token = g.advantage_estimator in TOKEN_LEVEL_ESTIMATORS
    components = reward_components(rollout.data)
    if per_token:
        advantages = torch.zeros_like(rewards)
    elif g.advantage_estimator == "gdpo":
        advantages = gdpo_step_advantages(cfg, components)
    else:
        advantages = group_advantages(rewards, g.num_generations_per_prompt, g.advantage_estimator)
    data = training_batch(rollout.data, advantages)
    if not per_token:  # Reinforce++'s come after the logprob passes
        data["advantages"] = final_advantages(g, data, rollout.data)
    if g.overlong_filtering:
        data["sample_mask"] = data["sample_mask"] * overlong_sample_mask(truncated)
    # decided once, when the config was resolved: without the pass the loss uses the current logprobs
    prev_pass = not loss_fn.cfg.force_on_policy_ratio
    with timer.phase("logprob"):
        add_logprob_inputs(cfg, policy, data, prev_pass)
    if per_token:
        data["advantages"] = token_advantages(cfg, data, rewards)
        data["advantages"] = final_advantages(g, data, rollout.data)
    if loss_fn.cfg.positive_example_nll_weight > 0:  # VAPO: the NLL of the step's rewarded completions
        from rlcore.algorithms.grpo.loss import positive_example_token_counts

        data["rewards"] = rewards
        data["positive_example_token_count"] = positive_example_token_counts(
            data["token_mask"], data["sample_mask"], rewards, cfg.policy.train_global_batch_size
        )
    result = train_step(run, data, loss_fn, timer)
    loss_metrics = result["metrics"]
    raw = rollout.rewards  # the environment's
    metrics = {
        "reward_mean": float(raw.mean()),
        "reward_std": float(raw.std()) if raw.numel() > 1 else 0.0,
        "loss": float(result["loss"].mean()),
        "grad_norm": float(result["grad_norm"].mean()),
        "skipped_steps": float(result.get("skipped_steps", 0)),  # non-finite loss or grad norm: no update
        **moe_metrics(result),
        "kl_penalty": float(loss_metrics.get("kl_penalty", 0.0)),
        # generation vs prev logprobs; without the pass prev = the current logprobs of the parameters
        # that sampled the rollout, so it is the same engine-vs-policy check
        "token_mult_prob_error": float(loss_metrics.get("token_mult_prob_error", float("nan"))),
        "prev_logprobs_pass": float(prev_pass),
        "mean_generation_length": float(rollout.data["generation_lengths"].sum()) / rewards.numel(),
        **rollout.metrics,
        **{f"reward/{name}_mean": float(values.mean()) for name, values in components.items()},  # the env's
    }
    if g.invalid_tool_call_advantage is not None and "invalid_tool_call_mask" in rollout.data:  # NeMo-RL logs it so
        metrics["invalid_tool_call_rate"] = invalid_tool_call_rate(rollout.data)
    if g.reward_scaling.enabled or g.reward_shaping.enabled:
        metrics["reward_transformed_mean"] = float(rewards.mean())  # what the advantages were computed from
    if g.overlong_filtering:
        metrics["overlong_filtered_fraction"] = float(truncated.float().mean())
    metrics.update(
        {
            key: float(loss_metrics[key])
            for key in (
                "clip_fraction",
                "sampling_importance_ratio",
                "is_oob_ratio",
                "positive_nll_loss",
                *ENGINE_GAP_METRICS,
            )
            if key in loss_metrics
        }
    )
    if all(name in loss_metrics for name in PEARSON_MOMENTS):  # the engine's and the trainer's logprobs
        metrics[PEARSON_NAME] = probs_pearson(loss_metrics)
    return metrics
