"""The PPO loop behind ``rlcore run`` (a config with a ``ppo`` section): a policy and a critic.

Per step (NeMo-RL's ``ppo_train``): take the next ``ppo.num_prompts_per_step`` prompts; refit the engines when the
policy's weights are stale; roll out ``num_generations_per_prompt`` completions each, scored by the environment;
scale and shape the rewards (``ppo.reward_scaling``, ``ppo.reward_shaping``); the critic (``run.value_model``, a
value-head Policy of ``ppo.value``'s settings over the policy's) gives its values at every generated token; the
policy gives ``prev_logprobs`` (and the reference's, for a KL term); GAE turns rewards and values into per-token
advantages and returns (``ppo.adv_estimator``); then ``ppo.ppo_epochs`` times, the critic trains on the returns
(:class:`~rlcore.algorithms.ppo.value_loss.ValueLossFn`, the ``value_loss`` section) and, once the critic's
warmup (``ppo.policy_training_start_step``) is over, the policy on the advantages (GRPO's ``ClippedPGLossFn``, the
``loss`` section). Validation is GRPO's: greedy completions scored by the environment.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlcore.algorithms.toolkit import Timer, generating, moe_metrics, sample_and_score, train_step, training_batch
from rlcore.interfaces.algorithm import Algorithm, OnStep, Resolution

if TYPE_CHECKING:
    from rlcore.run.build import Run


def score_rollout(run: Run, timer: Timer) -> tuple[Any, Any, dict[str, float]]:
    """Generate and score the step's rollout; returns the training batch (advantages not set yet), the transformed
    rewards ``[B]`` and the rollout's metrics."""
    import torch

    from rlcore.algorithms.grpo.reward_transforms import overlong_sample_mask, transform_rewards

    p = run.cfg.ppo
    with generating(run, timer):
        rollout = sample_and_score(run, timer, p.num_generations_per_prompt)
    truncated = rollout.data["truncated"]
    rewards = transform_rewards(p, rollout.rewards, rollout.data["first_turn_lengths"], truncated).rewards
    data = training_batch(rollout.data, torch.zeros_like(rewards))
    if p.overlong_filtering:
        data["sample_mask"] = data["sample_mask"] * overlong_sample_mask(truncated)
    raw = rollout.rewards
    metrics = {
        "reward_mean": float(raw.mean()),
        "reward_std": float(raw.std()) if raw.numel() > 1 else 0.0,
        "mean_generation_length": float(rollout.data["generation_lengths"].float().mean()),
        **rollout.metrics,
    }
    if p.reward_scaling.enabled or p.reward_shaping.enabled:
        metrics["reward_transformed_mean"] = float(rewards.mean())
    return data, rewards, metrics


def add_advantages(run: Run, data: Any, rewards: Any, timer: Timer) -> None:
    """The critic's values, the policy's logprob passes, and GAE's advantages and returns, into ``data``."""
    from rlcore.algorithms.grpo.step import add_logprob_inputs
    from rlcore.algorithms.ppo.gae import batch_advantages
    from rlcore.algorithms.ppo.value_loss import OLD_VALUES_KEY, RETURNS_KEY

    with timer.phase("value"):
        run.value_model.prepare_for_lp_inference()
        data[OLD_VALUES_KEY] = run.value_model.get_values(data)["values"]
    with timer.phase("logprob"):  # ppo_epochs > 1 moves the policy between epochs: the ratio needs the pass
        add_logprob_inputs(run.cfg, run.policy, data, prev_pass=True)
    gae = batch_advantages(run.cfg.ppo.adv_estimator, run.cfg.loss, data, rewards)
    data["advantages"], data[RETURNS_KEY] = gae.advantages, gae.returns


def train_critic(run: Run, data: Any, value_loss: Any, timer: Timer) -> dict[str, Any]:
    """One pass of the critic over ``data`` (its own ``train_global_batch_size`` per optimizer step)."""
    with timer.phase("value_train"):
        run.value_model.prepare_for_training()
        result = run.value_model.train(data, value_loss)
        run.value_model.finish_training()
    return result


def ppo_step(run: Run, step: int, policy_loss: Any, value_loss: Any) -> dict[str, float]:
    """One PPO step: roll out and score, values and advantages, ``ppo_epochs`` of critic then policy updates."""
    from rlcore.algorithms.ppo.value_loss import explained_variance
    from rlcore.run.step import peak_memory_metrics

    p, timer = run.cfg.ppo, Timer()
    data, rewards, metrics = score_rollout(run, timer)
    add_advantages(run, data, rewards, timer)
    policy_trains = p.policy_trains(step)
    critic: list[dict[str, Any]] = []
    actor: list[dict[str, Any]] = []
    for _ in range(p.ppo_epochs):
        critic.append(train_critic(run, data, value_loss, timer))
        if policy_trains:
            actor.append(train_step(run, data, policy_loss, timer))
    first = critic[0]["metrics"]  # the critic's fit before this step's updates moved it
    metrics.update(
        {
            "value_loss": float(critic[-1]["loss"].mean()),
            "value_grad_norm": float(critic[-1]["grad_norm"].mean()),
            "value_clip_fraction": float(first.get("vf_clipfrac", 0.0)),
            "values_mean": float(first["values_mean"]),
            "returns_mean": float(first["returns_mean"]),
            "explained_variance": explained_variance(first),
            "advantages_mean": float(data["advantages"][data["token_mask"] != 0].mean()),
            "policy_trained": float(policy_trains),
            "skipped_steps": float(sum(r.get("skipped_steps", 0) for r in critic + actor)),
        }
    )
    if actor:
        loss_metrics = actor[-1]["metrics"]
        metrics.update(
            {
                "loss": float(actor[-1]["loss"].mean()),
                "grad_norm": float(actor[-1]["grad_norm"].mean()),
                **moe_metrics(actor[-1]),
                **{k: float(loss_metrics[k]) for k in ("clip_fraction", "token_mult_prob_error") if k in loss_metrics},
            }
        )
    return {
        **metrics,
        "epoch": float(run.data.train.epoch_of(run.next_batch - 1)),
        "time/step_s": sum(timer.seconds.values()),
        **timer.seconds,
        **peak_memory_metrics(run.policy, run.generation, value=run.value_model),
    }


class PPO(Algorithm):
    """PPO with a critic: GAE advantages on a value model's estimates, ``ppo_epochs`` updates per rollout."""

    headline = ("reward_mean", "validation/accuracy")
    curve = ("reward_mean", "mean reward", "reward_curve.png")

    def resolve(self, cfg: Any, policy: Any, generation: Any, registry: Any, notices: list[str]) -> Resolution:
        """The critic: a value-head Policy of ``ppo.value`` over the policy's settings, on a backend declaring
        ``value_head``; every rollout must fill whole global batches of both models."""
        from rlcore.config import ConfigError
        from rlcore.config.resolve import resolve_policy
        from rlcore.plugins import Capability

        p = cfg.ppo
        problems = []
        if p.async_ppo.enabled:
            problems.append(
                "ppo.async_ppo.enabled: asynchronous PPO is not supported yet (generation ahead of a critic's and "
                "a policy's training); set it to false"
            )
        if p.skip_reference_policy_logprobs_calculation and cfg.loss.reference_policy_kl_penalty > 0:
            problems.append(
                f"ppo.skip_reference_policy_logprobs_calculation: true, but loss.reference_policy_kl_penalty is "
                f"{cfg.loss.reference_policy_kl_penalty}: the KL term needs the reference's logprobs; set one of "
                "them to false / 0"
            )
        try:
            critic = resolve_policy(
                p.value_policy(cfg.policy), world_size=cfg.world_size, use_gpu=cfg.cluster.use_gpu, registry=registry
            )
        except ConfigError as exc:
            return Resolution(cfg, problems + [_as_value(line) for line in exc.problems])
        if not critic.spec.supports(Capability.VALUE_HEAD):
            problems.append(
                f"ppo.value: the critic's '{critic.spec.name}' training backend cannot build a value model "
                "(capability 'value_head'); give the critic a backend that declares it (ppo.value.backend: "
                "dtensor or megatron)"
            )
        rollout = p.num_prompts_per_step * p.num_generations_per_prompt
        for who, resolved, path in (("policy", policy, "policy"), ("critic", critic, "ppo.value")):
            gbs = resolved.config.train_global_batch_size
            if rollout % gbs or rollout % resolved.data_parallel_size:
                problems.append(
                    f"ppo.num_prompts_per_step × num_generations_per_prompt = {rollout} must be a multiple of the "
                    f"{who}'s train_global_batch_size {gbs} ({path}.train_global_batch_size) and of its "
                    f"data-parallel size {resolved.data_parallel_size}; change one of them"
                )
        if problems:
            return Resolution(cfg, problems)
        cfg = cfg.model_copy(update={"loss": cfg.loss.model_copy(update={"force_on_policy_ratio": False})})
        return Resolution(cfg, [], value_model=critic)

    def load_data(self, cfg: Any, tokenizer: Any) -> Any:
        from rlcore.datasets import load_sources
        from rlcore.run.step import prompt_length_of

        return load_sources(cfg, prompt_length_of(cfg, tokenizer))

    def needs_reference_model(self, cfg: Any) -> bool:
        return not cfg.ppo.skip_reference_policy_logprobs_calculation and cfg.loss.reference_policy_kl_penalty > 0

    def train(self, run: Run, on_step: OnStep) -> str | None:
        from rlcore.algorithms.grpo.loss import ClippedPGLossFn
        from rlcore.algorithms.ppo.value_loss import ValueLossFn
        from rlcore.algorithms.toolkit import train_rollout_steps

        policy_loss, value_loss = ClippedPGLossFn(run.cfg.loss), ValueLossFn(run.cfg.value_loss)
        return train_rollout_steps(run, lambda step: ppo_step(run, step, policy_loss, value_loss), on_step)

    def validate(self, run: Run) -> dict[str, float]:
        from rlcore.run.validation import synchronous_generate, validate

        return validate(run, synchronous_generate(run))

    def what(self, cfg: Any) -> str:
        critic = cfg.ppo.value.get("backend")
        return f"PPO with a critic{f' on {critic}' if critic else ''}, "


def _as_value(problem: str) -> str:
    """A problem of the critic's policy, named where it is fixed (``ppo.value.<key>`` over the policy's)."""
    import re

    named = re.sub(r"\bpolicy\.", "ppo.value.", problem)
    return named if named.startswith("ppo.value.") else f"ppo.value: {named}"
