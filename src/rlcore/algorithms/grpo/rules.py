"""GRPO's cross-field rules, over the whole config: its section (``grpo``) and the ``loss`` section it owns.

The core runs them through the registry (the spec's ``rules``, :func:`check`) when the config trains GRPO or sets
``loss``; each yields problem lines that name the dotted path(s), the bad value(s) and the fix. ``cfg.grpo`` is
None for a config without the section (the default algorithm, until a run fills it in), and every rule that reads
it says so. Light: no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from rlcore.algorithms.grpo.config import TOKEN_LEVEL_ESTIMATORS

if TYPE_CHECKING:
    from rlcore.config.schemas import RLCoreConfig

GRPO_RULES: list[Callable[[RLCoreConfig], Iterable[str]]] = []


def _grpo_rule(fn: Callable[[RLCoreConfig], Iterator[str]]) -> Callable[[RLCoreConfig], Iterator[str]]:
    GRPO_RULES.append(fn)
    return fn


def check(cfg: RLCoreConfig) -> Iterator[str]:
    """Every GRPO rule's problem lines (the spec's ``rules``)."""
    for fn in GRPO_RULES:
        yield from fn(cfg)


@_grpo_rule
def async_grpo_needs_its_own_engine(cfg: RLCoreConfig) -> Iterator[str]:
    """Async GRPO overlaps a separate engine with training: it needs its own resources. (Without importance
    weights it trains on older rollouts as if on-policy: a notice at resolve, :func:`uncorrected_notice`.)"""
    if cfg.grpo is None or not cfg.grpo.async_grpo.enabled:
        return
    gen, p = cfg.policy.generation, cfg.policy
    if gen is not None and gen.backend != p.training_backend and gen.colocated.enabled:
        yield (
            "grpo.async_grpo.enabled: generation can run ahead of training only on its own resources, but "
            "policy.generation.colocated.enabled is true; set it to false and give "
            "policy.generation.colocated.resources (e.g. {num_nodes: 1, workers_per_node: 1})"
        )


@_grpo_rule
def in_flight_settings_need_in_flight_updates(cfg: RLCoreConfig) -> Iterator[str]:
    """In-flight weight updates act only in asynchronous GRPO, and their two settings only with them (a setting
    that is accepted does what it says). Whether the engine can take weights mid-request is the backend's
    capability, checked when the run is resolved (``GRPO.resolve`` in :mod:`rlcore.algorithms.grpo.loop`)."""
    if cfg.grpo is None:
        return
    a = cfg.grpo.async_grpo
    prefix = "grpo.async_grpo."
    if a.in_flight_weight_updates and not a.enabled:
        yield (
            f"{prefix}in_flight_weight_updates: is true, but refits land during generation only when generation "
            f"runs ahead of training; set {prefix}enabled=true or in_flight_weight_updates=false"
        )
    if a.in_flight_pause_mode != "keep" and not a.in_flight_weight_updates:
        yield (
            f"{prefix}in_flight_pause_mode: is '{a.in_flight_pause_mode}', but it is read only with in-flight "
            f"weight updates (without them every refit waits for the requests running); set "
            f"{prefix}in_flight_weight_updates=true or remove in_flight_pause_mode"
        )
    keeps_requests = a.in_flight_weight_updates and a.in_flight_pause_mode == "keep"
    lora = cfg.policy.lora
    if keeps_requests and lora.enabled and lora.refit == "adapter":
        yield (
            f"{prefix}in_flight_pause_mode: is 'keep' with policy.lora.refit 'adapter', but an adapter refit swaps "
            "the engine's LoRA adapter, and the requests kept across it would run on one it removed; set "
            f"{prefix}in_flight_pause_mode to abort or wait, or policy.lora.refit to merged"
        )
    if a.recompute_kv_cache_after_weight_updates and not keeps_requests:
        why = (
            "without in-flight weight updates no request runs across a refit"
            if not a.in_flight_weight_updates
            else f"with in_flight_pause_mode '{a.in_flight_pause_mode}' no request keeps a cache across a refit"
        )
        yield (
            f"{prefix}recompute_kv_cache_after_weight_updates: is true, but {why}, so there is no KV cache to "
            f"recompute; set {prefix}in_flight_weight_updates=true with in_flight_pause_mode=keep, or set "
            "recompute_kv_cache_after_weight_updates=false"
        )


@_grpo_rule
def rollout_batch_fits_training(cfg: RLCoreConfig) -> Iterator[str]:
    g, p = cfg.grpo, cfg.policy
    if g is None:
        return
    rollout = g.num_prompts_per_step * g.num_generations_per_prompt
    if rollout % p.train_global_batch_size:
        yield (
            f"grpo.num_prompts_per_step × grpo.num_generations_per_prompt = {g.num_prompts_per_step} × "
            f"{g.num_generations_per_prompt} = {rollout} is not a multiple of policy.train_global_batch_size "
            f"{p.train_global_batch_size}: each step trains on whole global batches; change one of them"
        )
    if cfg.loss.force_on_policy_ratio is True and rollout != p.train_global_batch_size:
        yield (
            f"loss.force_on_policy_ratio needs each rollout trained in one optimizer step, but the rollout "
            f"batch {rollout} != policy.train_global_batch_size {p.train_global_batch_size}: set them equal, "
            "or set it to null (automatic: on only when they are equal) or false"
        )
    if g.advantage_estimator.startswith("leave_one_out") and g.num_generations_per_prompt < 2:
        yield (
            f"grpo.num_generations_per_prompt: {g.advantage_estimator} advantages need at least 2 completions "
            "per prompt; raise it or set grpo.advantage_estimator=mean_std"
        )


@_grpo_rule
def kl_in_reward_needs_reinforce_plus_plus(cfg: RLCoreConfig) -> Iterator[str]:
    """The KL moves from the loss into the reward only where an estimator puts it there; elsewhere it would
    vanish (NeMo-RL drops it silently)."""
    loss = cfg.loss
    if not loss.use_kl_in_reward:
        return
    estimator = cfg.grpo.advantage_estimator if cfg.grpo is not None else None
    # another algorithm's (PPO's GAE) reads it its own way (rlcore.algorithms.ppo.rewards)
    if cfg.algorithm == "grpo" and estimator not in TOKEN_LEVEL_ESTIMATORS:
        yield (
            f"loss.use_kl_in_reward: only the Reinforce++ advantages put the KL into the reward, but "
            f"grpo.advantage_estimator is {estimator}; set it to reinforce_plus_plus[_baseline] or set "
            "use_kl_in_reward to false (KL in the loss)"
        )
    if loss.reference_policy_kl_penalty == 0:
        yield (
            "loss.use_kl_in_reward: the KL coefficient loss.reference_policy_kl_penalty is 0, so there is no "
            "KL to put into the reward; set a coefficient > 0 or set use_kl_in_reward to false"
        )
    if loss.force_on_policy_ratio is True:
        yield (
            "loss.force_on_policy_ratio: true skips the prev-logprob pass, but loss.use_kl_in_reward computes "
            "the reward's KL from those logprobs before training; set it to null (automatic) or false"
        )


@_grpo_rule
def reward_transforms_not_with_async_grpo(cfg: RLCoreConfig) -> Iterator[str]:
    """NeMo-RL's async GRPO refuses dynamic sampling, reward scaling and reward shaping (examples/run_grpo.py)."""
    g = cfg.grpo
    if g is None or not g.async_grpo.enabled:
        return
    for path, on in (
        ("grpo.use_dynamic_sampling", g.use_dynamic_sampling),
        ("grpo.reward_scaling.enabled", g.reward_scaling.enabled),
        ("grpo.reward_shaping.enabled", g.reward_shaping.enabled),
    ):
        if on:
            yield (
                f"{path}: is true, but it is not supported with async GRPO (grpo.async_grpo.enabled), as in "
                f"NeMo-RL; set {path}=false or grpo.async_grpo.enabled=false"
            )


@_grpo_rule
def batch_multiplier_only_with_dynamic_sampling(cfg: RLCoreConfig) -> Iterator[str]:
    """batch_multiplier only sizes dynamic sampling's generation batches (NeMo-RL asserts it is 1 without)."""
    g = cfg.grpo
    if g is not None and not g.use_dynamic_sampling and g.batch_multiplier != 1:
        yield (
            f"grpo.batch_multiplier: is {g.batch_multiplier}, but it only sizes the generation batches of "
            "dynamic sampling; set grpo.use_dynamic_sampling=true or grpo.batch_multiplier=1"
        )


@_grpo_rule
def advantage_clip_bounds_around_zero(cfg: RLCoreConfig) -> Iterator[str]:
    """Advantages are centred on 0: a bound on the wrong side of 0 gives every advantage beyond it the same sign
    (NeMo-RL does not check; its docs describe symmetric bounds such as -100/100)."""
    g = cfg.grpo
    if g is None:
        return
    low, high = g.advantage_clip_low, g.advantage_clip_high
    if low is not None and high is not None and low > high:
        yield (
            f"grpo.advantage_clip_low, grpo.advantage_clip_high: {low} > {high}; the low bound must not exceed "
            "the high one"
        )
        return
    if low is not None and low > 0:
        yield (
            f"grpo.advantage_clip_low: is {low} > 0, so every advantage below it, all negative ones included, "
            f"would become +{low} (bad completions pushed up); set it <= 0 (e.g. -5) or null"
        )
    if high is not None and high < 0:
        yield (
            f"grpo.advantage_clip_high: is {high} < 0, so every advantage above it, all positive ones "
            f"included, would become {high} (good completions pushed down); set it >= 0 (e.g. 5) or null"
        )


@_grpo_rule
def reward_scaling_range(cfg: RLCoreConfig) -> Iterator[str]:
    g = cfg.grpo
    if g is None or not g.reward_scaling.enabled:
        return
    sc = g.reward_scaling
    if sc.source_max <= sc.source_min:
        yield (
            f"grpo.reward_scaling.source_max: is {sc.source_max}, not above grpo.reward_scaling.source_min "
            f"{sc.source_min}; the source range must not be empty: set source_max > source_min"
        )


@_grpo_rule
def reward_shaping_has_its_settings(cfg: RLCoreConfig) -> Iterator[str]:
    """DAPO's overlong penalty needs its three settings (NeMo-RL raises at the first step without them); the
    truncation penalty (stop_properly_penalty_coef) needs none of them."""
    g = cfg.grpo
    if g is None or not g.reward_shaping.enabled or g.reward_shaping.stop_properly_penalty_coef is not None:
        return
    sh = g.reward_shaping
    missing = [
        f"grpo.reward_shaping.{k}"
        for k in ("overlong_buffer_length", "overlong_buffer_penalty", "max_response_length")
        if getattr(sh, k) is None
    ]
    if missing:
        yield (
            f"{', '.join(missing)}: {'is' if len(missing) == 1 else 'are'} null, but DAPO's overlong penalty "
            "(grpo.reward_shaping.enabled without stop_properly_penalty_coef) needs it; set "
            f"{'it' if len(missing) == 1 else 'them'} (e.g. overlong_buffer_length: 128, "
            "overlong_buffer_penalty: 1, max_response_length: the longest completion), or set "
            "stop_properly_penalty_coef to penalize truncation instead"
        )
    elif sh.overlong_buffer_length > sh.max_response_length:
        yield (
            f"grpo.reward_shaping.overlong_buffer_length: is {sh.overlong_buffer_length}, more than "
            f"grpo.reward_shaping.max_response_length {sh.max_response_length}, so even an empty completion "
            "would be penalized; make the buffer at most max_response_length"
        )


@_grpo_rule
def gdpo_settings_reach_gdpo(cfg: RLCoreConfig) -> Iterator[str]:
    """grpo.gdpo is read only by GDPO, and GDPO reads the reward components, which reward shaping does not touch
    (NeMo-RL shapes the total reward only, so under GDPO its penalties silently change nothing)."""
    g = cfg.grpo
    if g is None:
        return
    if g.advantage_estimator != "gdpo":
        default = type(g.gdpo)()
        changed = [f"grpo.gdpo.{k}" for k in type(g.gdpo).model_fields if getattr(g.gdpo, k) != getattr(default, k)]
        if changed:
            yield (
                f"{', '.join(changed)}: only GDPO reads {'it' if len(changed) == 1 else 'them'}, but "
                f"grpo.advantage_estimator is {g.advantage_estimator}; set grpo.advantage_estimator=gdpo or "
                f"remove {'it' if len(changed) == 1 else 'them'}"
            )
        return
    if g.reward_shaping.enabled:
        yield (
            "grpo.reward_shaping.enabled: is true, but GDPO's advantages come from the environment's reward "
            "components, which the shaping penalties do not touch (NeMo-RL shapes the total reward only); set "
            "it to false, or set grpo.advantage_estimator to a GRPO estimator (e.g. leave_one_out_std)"
        )
    if g.gdpo.use_leave_one_out_baseline and g.num_generations_per_prompt < 2:
        yield (
            "grpo.num_generations_per_prompt: GDPO with grpo.gdpo.use_leave_one_out_baseline needs at least 2 "
            "completions per prompt; raise it or set use_leave_one_out_baseline=false"
        )
