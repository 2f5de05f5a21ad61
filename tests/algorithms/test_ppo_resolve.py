"""What PPO decides when a run's config is resolved (no process starts): the critic is a value-head Policy of
``ppo.value`` over the policy's settings, on a backend declaring ``value_head``; every refusal is one line naming
the setting to change."""

from __future__ import annotations

import pytest

from rlcore.config import ConfigError, load_config, resolve

EXAMPLE = "examples/ppo_tiny.yaml"


def resolved(*overrides: str):
    return resolve(load_config(EXAMPLE, list(overrides)), run=True)


def problems(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        resolved(*overrides)
    return caught.value.problems


def test_the_critic_is_the_policy_s_settings_with_its_own_and_no_generation() -> None:
    r = resolved("ppo.value.learning_rate=0.5", "ppo.value.train_global_batch_size=16")
    critic, policy = r.value_model.config, r.policy.config
    assert (critic.learning_rate, critic.train_global_batch_size) == (0.5, 16)
    assert (policy.learning_rate, policy.train_global_batch_size) == (3.0e-3, 32)
    assert critic.model_name == policy.model_name and critic.generation is None
    assert r.value_model.spec.name == "dtensor" and r.policy_head == "lm"
    assert r.config.loss.force_on_policy_ratio is False  # ppo_epochs > 1: the ratio needs the prev-logprob pass


def test_a_critic_backend_without_a_value_head_is_refused_by_name() -> None:
    [line] = problems("ppo.value.backend=fsdp1", "ppo.value.dtensor_cfg.enabled=false")
    assert line.startswith("ppo.value: the critic's 'fsdp1' training backend cannot build a value model"), line


def test_a_rollout_that_is_not_whole_critic_batches_is_refused() -> None:
    [line] = problems("ppo.value.train_global_batch_size=64")
    assert "critic's train_global_batch_size 64 (ppo.value.train_global_batch_size)" in line, line
    [line] = problems("ppo.value.train_global_batch_size=24")  # the critic's own layout rules, under its name
    assert line.startswith("ppo.value.train_global_batch_size: 24 is not divisible") and "policy." not in line, line


def test_asynchronous_ppo_is_refused_in_one_line() -> None:
    [line] = problems("ppo.async_ppo.enabled=true")
    assert line.startswith("ppo.async_ppo.enabled: asynchronous PPO is not supported yet"), line


def test_a_kl_term_without_reference_logprobs_is_refused() -> None:
    [line] = problems("loss.reference_policy_kl_penalty=0.1")
    assert line.startswith("ppo.skip_reference_policy_logprobs_calculation: true, but loss.reference_policy_kl_p")
    r = resolved("loss.reference_policy_kl_penalty=0.1", "ppo.skip_reference_policy_logprobs_calculation=false")
    assert r.config.loss.reference_policy_kl_penalty == 0.1
