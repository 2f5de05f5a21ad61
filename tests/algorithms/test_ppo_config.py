"""The ppo and value_loss_fn sections (rlcore.algorithms.ppo.config): NeMo-RL's defaults, every key NeMo-RL's PPO
configs and recipes write accepted (or refused by name, with the fix), and the validators that refuse what
rlcore does not do. NeMo-RL's sections are embedded as they are written there (examples/configs/ppo_math_1B.yaml,
whose megatron variant only inherits it, and the seven examples/configs/recipes/llm/ppo-*.yaml)."""

from __future__ import annotations

import copy

import pytest
from pydantic import ValidationError

from rlcore.algorithms.ppo.config import PPOConfig, ValueLossConfig
from rlcore.config.policy import PolicyConfig

#: ppo_math_1B.yaml's ppo section.
NEMO_RL_PPO = {
    "num_prompts_per_step": 32,
    "num_generations_per_prompt": 16,
    "max_rollout_turns": 1,
    "max_num_epochs": 100000,
    "max_num_steps": 100000,
    "ppo_epochs": 4,
    "policy_training_start_step": 0,
    "val_period": 20,
    "val_at_start": True,
    "val_at_end": False,
    "overlong_filtering": False,
    "max_val_samples": 256,
    "val_batch_size": 256,
    "seed": 42,
    "use_dynamic_sampling": False,
    "dynamic_sampling_max_gen_batches": 10,
    "batch_multiplier": 1,
    "skip_reference_policy_logprobs_calculation": True,
    "async_ppo": {
        "enabled": False,
        "max_trajectory_age_steps": 1,
        "warmup_generation_lead_steps": None,
        "in_flight_weight_updates": False,
        "recompute_kv_cache_after_weight_updates": False,
        "drop_incomplete_targets_on_restore": False,
    },
    "reward_shaping": {
        "enabled": True,
        "overlong_buffer_length": 2048,
        "overlong_buffer_penalty": 1,
        "max_response_length": 14336,
        "stop_properly_penalty_coef": None,
    },
    "adv_estimator": {
        "name": "gae",
        "gae_lambda": 0.95,
        "gae_gamma": 1,
        "normalize_advantages": True,
        "gae_lambda_value": None,
        "gae_lambda_policy": None,
        "length_adaptive_alpha": 0.0,
    },
    "reward_scaling": {"enabled": True, "source_min": 0.0, "source_max": 1.0, "target_min": -1.0, "target_max": 1.0},
    "seq_logprob_error_threshold": None,
}
NEMO_RL_VALUE_LOSS = {"scale": 0.4, "cliprange": 0.2}

_GSM8K = {
    "num_prompts_per_step": 1024,
    "num_generations_per_prompt": 1,
    "max_num_epochs": 15,
    "ppo_epochs": 1,
    "val_period": 1,
    "overlong_filtering": True,
    "reward_shaping": {"enabled": False},
    "adv_estimator": {"gae_lambda_value": 1.0, "gae_lambda_policy": 1},
    "reward_scaling": {"enabled": False},
}
_ASYNC = {**_GSM8K, "max_num_epochs": -1}
#: Each recipe's ppo overrides (merged over NEMO_RL_PPO, as its defaults: line does) and its value_loss_fn.
NEMO_RL_RECIPES = {
    "ppo-dsr1-7b-math-8n8g-megatron": {
        "num_prompts_per_step": 2048,
        "num_generations_per_prompt": 1,
        "ppo_epochs": 1,
        "max_num_steps": 20,
        "val_period": 5,
        "val_at_start": False,
        "skip_reference_policy_logprobs_calculation": False,
        "reward_shaping": {"enabled": False},
        "adv_estimator": {"gae_lambda": 1},
    },
    "ppo-qwen2.5-1.5b-gsm8k-1n8g-automodel-noncolocated-async": {
        **_ASYNC,
        "policy_training_start_step": 5,
        "async_ppo": {"enabled": True, "warmup_generation_lead_steps": 2, "in_flight_weight_updates": True},
    },
    "ppo-qwen2.5-1.5b-gsm8k-1n8g-automodel-noncolocated": _GSM8K,
    "ppo-qwen2.5-1.5b-gsm8k-1n8g-automodel-valuetp2sp": _GSM8K,
    "ppo-qwen2.5-1.5b-gsm8k-1n8g-megatron-valuetp2sp-dynbatch": _GSM8K,  # and -pp2cp2-pack, which inherits it
    "ppo-qwen2.5-1.5b-gsm8k-2n8g-megatron-valuetp2sp-dynbatch-noncolocated-async": {
        **_ASYNC,
        "async_ppo": {"enabled": True, "in_flight_weight_updates": True},
    },
    "ppo-qwen2.5-1.5b-gsm8k-2n8g-megatron-valuetp2sp-dynbatch-noncolocated": _GSM8K,
}
RECIPE_VALUE_LOSS = {"scale": 1.0, "cliprange": 0.5}  # every recipe's value_loss_fn

#: NeMo-RL's PPOConfig / MseValueLossConfig class defaults (what a key left out means there).
NEMO_RL_DEFAULTS = {
    "num_prompts_per_step": 32,
    "num_generations_per_prompt": 16,
    "max_num_epochs": 100000,
    "max_num_steps": 100000,
    "max_rollout_turns": 1,
    "val_period": 20,
    "val_batch_size": 256,
    "val_at_start": True,
    "val_at_end": False,
    "max_val_samples": 256,
    "skip_reference_policy_logprobs_calculation": True,
    "seed": 42,
    "overlong_filtering": False,
    "use_dynamic_sampling": False,
    "dynamic_sampling_max_gen_batches": 10,
    "batch_multiplier": 1.0,
    "ppo_epochs": 4,
    "policy_training_start_step": 0,
    "seq_logprob_error_threshold": None,
    "reward_shaping.enabled": False,
    "reward_scaling.enabled": False,
    "reward_scaling.target_min": 0.0,
    "adv_estimator.name": "gae",
    "adv_estimator.gae_lambda": 0.95,
    "adv_estimator.gae_gamma": 1.0,
    "adv_estimator.normalize_advantages": True,
    "adv_estimator.gae_lambda_value": None,
    "adv_estimator.gae_lambda_policy": None,
    "adv_estimator.length_adaptive_alpha": 0.0,
    "async_ppo.enabled": False,
    "async_ppo.max_trajectory_age_steps": 1,
    "async_ppo.warmup_generation_lead_steps": None,
    "async_ppo.in_flight_weight_updates": False,
    "async_ppo.recompute_kv_cache_after_weight_updates": False,
    "async_ppo.drop_incomplete_targets_on_restore": False,
}

#: NeMo-RL values rlcore refuses, with the words the refusal must contain.
REFUSED = {
    "adv_estimator.name": ("raw_reward", "ppo.adv_estimator.name"),
    "use_dynamic_sampling": (True, "ppo.use_dynamic_sampling"),
    "batch_multiplier": (2.0, "ppo.batch_multiplier"),
    "seq_logprob_error_threshold": (2.0, "ppo.seq_logprob_error_threshold"),
}


def merged(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def dotted(section: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in section.items():
        if isinstance(value, dict):
            out.update(dotted(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def get(cfg: object, path: str) -> object:
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return cfg


def test_defaults_are_nemo_rls():
    cfg, value_loss = PPOConfig(), ValueLossConfig()
    for path, expected in NEMO_RL_DEFAULTS.items():
        assert get(cfg, path) == expected, path
    assert (value_loss.scale, value_loss.cliprange) == (1.0, None)
    every_field_documented(PPOConfig)
    every_field_documented(ValueLossConfig)


def every_field_documented(model: type) -> None:
    for name, field in model.model_fields.items():  # type: ignore[attr-defined]
        assert field.description, f"{model.__name__}.{name} has no description"
        sub = field.annotation
        if isinstance(sub, type) and hasattr(sub, "model_fields"):
            every_field_documented(sub)


def test_every_nemo_rl_ppo_key_is_accepted_with_its_value():
    sections = {"ppo_math_1B": NEMO_RL_PPO, **{k: merged(NEMO_RL_PPO, v) for k, v in NEMO_RL_RECIPES.items()}}
    for name, section in sections.items():
        cfg = PPOConfig.model_validate(section)
        for path, value in dotted(section).items():
            got = get(cfg, path)
            if path == "max_num_epochs" and value == -1:
                assert got is None, name  # NeMo-RL's async 'cycle the data': no epoch bound
            else:
                assert got == value, (name, path, got, value)
    for section in (NEMO_RL_VALUE_LOSS, RECIPE_VALUE_LOSS):
        assert ValueLossConfig.model_validate(section).model_dump() == section


@pytest.mark.parametrize("path", sorted(REFUSED))
def test_refused_nemo_rl_values_name_their_path(path):
    value, words = REFUSED[path]
    head, _, leaf = path.rpartition(".")
    section = copy.deepcopy(NEMO_RL_PPO)
    (section[head] if head else section)[leaf] = value
    with pytest.raises(ValidationError, match=words.replace(".", r"\.")):
        PPOConfig.model_validate(section)


@pytest.mark.parametrize(
    "change,words",
    [
        ({"adv_estimator": {"length_adaptive_alpha": 0.05, "gae_lambda_policy": 0.9}}, "gae_lambda_policy"),
        ({"adv_estimator": {"gae_lambda": 1.5}}, "gae_lambda"),
        ({"async_ppo": {"max_trajectory_age_steps": 3, "warmup_generation_lead_steps": 2}}, "warmup_generation_lead"),
        ({"async_ppo": {"enabled": True, "warmup_generation_lead_steps": 2}}, "policy_training_start_step"),
        ({"reward_scaling": {"source_min": 1.0, "source_max": 1.0}}, r"ppo\.reward_scaling\.source_max"),
        ({"reward_shaping": {"overlong_buffer_length": None}}, r"ppo\.reward_shaping\.enabled"),
        ({"ppo_epochs": 0}, "ppo_epochs"),
        ({"unknown_key": 1}, "unknown_key"),
    ],
)
def test_settings_rlcore_cannot_honour_are_refused(change, words):
    with pytest.raises(ValidationError, match=words):
        PPOConfig.model_validate(merged(NEMO_RL_PPO, change))


def test_vapo_settings_and_value_loss_bounds():
    vapo = PPOConfig.model_validate(
        merged(NEMO_RL_PPO, {"adv_estimator": {"gae_lambda_value": 1.0, "length_adaptive_alpha": 0.05}})
    )
    assert vapo.adv_estimator.decoupled and vapo.adv_estimator.lambda_value == 1.0
    assert not PPOConfig().adv_estimator.decoupled and PPOConfig().adv_estimator.lambda_value == 0.95
    warm = PPOConfig(policy_training_start_step=2)
    assert [warm.policy_trains(step) for step in range(4)] == [False, False, True, True]
    lead = PPOConfig.model_validate(
        merged(NEMO_RL_PPO, NEMO_RL_RECIPES["ppo-qwen2.5-1.5b-gsm8k-1n8g-automodel-noncolocated-async"])
    )
    assert (
        lead.async_ppo.generation_lead_during_warmup == 2 and PPOConfig().async_ppo.generation_lead_during_warmup == 1
    )
    for bad in ({"scale": 0.0}, {"cliprange": 0.0}, {"clip": 0.2}):
        with pytest.raises(ValidationError):
            ValueLossConfig.model_validate(bad)


def test_the_critic_s_settings_merge_over_the_policy_s():
    policy = PolicyConfig.model_validate(
        {
            "model_name": "tiny-llama",
            "precision": "float32",
            "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-6, "weight_decay": 0.01}},
            "tokenizer": {"name": "tiny-llama"},
        }
    )
    cfg = PPOConfig(value={"optimizer": {"kwargs": {"lr": 1e-5}}, "model_name": "tiny-critic"})
    critic = cfg.value_policy(policy)
    assert critic["optimizer"] == {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-5, "weight_decay": 0.01}}
    assert (critic["model_name"], critic["precision"], critic["generation"]) == ("tiny-critic", "float32", None)
    assert critic["tokenizer"] == {"name": "tiny-llama"}
    assert PPOConfig().value_policy(policy)["model_name"] == "tiny-llama"
    for key in ("generation", "tokenizer"):
        with pytest.raises(ValidationError, match=rf"ppo\.value\.{key}"):
            PPOConfig(value={key: {}})
