"""NeMo-RL configs for an algorithm rlcore does not run, or for two, are refused in one line that names the algorithm
and what to use instead, not in one "unknown key" line per key of their sections; reward-model training, once refused
so, converts (its only refusal left: a reward model type other than Bradley-Terry)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlcore.config import ConfigError
from rlcore.nemo_rl import load_nemo_rl_config

FIXTURES = Path(__file__).parents[1] / "fixtures" / "nemo_rl"
UNKNOWN = "a NeMo-RL key rlcore's reader does not know"


def refusal(path: Path, overrides: list[str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_nemo_rl_config(path, overrides or [])
    return caught.value.problems


def test_reward_model_training_converts_and_other_reward_model_types_are_refused_in_one_line() -> None:
    rows = Path(__file__).parents[2] / "src" / "rlcore" / "examples" / "data" / "preference_dpo.jsonl"
    data = [
        f"++data.{s}.{k}={v}"
        for s in ("train", "validation")
        for k, v in (("dataset_name", "BinaryPreferenceDataset"), ("data_path", rows))
    ]
    loaded = load_nemo_rl_config(
        FIXTURES / "main" / "rm.yaml", ["policy.model_name=tiny-llama", *data], ["cluster.use_gpu=false"]
    )
    assert loaded.config.algorithm == "rm" and loaded.config.rm.val_period == 16
    assert loaded.config.checkpointing.metric_name == "validation/loss"
    problems = refusal(FIXTURES / "main" / "rm.yaml", ["policy.reward_model_cfg.reward_model_type=regression", *data])
    assert not [line for line in problems if UNKNOWN in line], problems
    assert [line for line in problems if line.startswith("policy.reward_model_cfg")] == [
        'policy.reward_model_cfg: is {"enabled": true, "reward_model_type": "regression"}; rlcore trains '
        "Bradley-Terry reward models only: set enabled: true and reward_model_type: bradley_terry"
    ], problems


def test_a_grpo_section_beside_a_ppo_one_is_refused_as_two_algorithms() -> None:
    """A GRPO config that also carries a ``ppo`` section trains two algorithms: one line says so."""
    rows = FIXTURES / "math.jsonl"
    problems = refusal(
        FIXTURES / "main" / "grpo_math_1B.yaml", [f"++data.train.data_path={rows}", "++ppo.ppo_epochs=4"]
    )
    assert problems == ["grpo, ppo: a config trains one algorithm; keep one of the sections"], problems


def test_grpo_with_a_reward_model_environment_converts_and_other_reward_model_types_are_refused() -> None:
    """grpo_rm_1B.yaml is GRPO scored by a reward model: env.reward_model becomes the reward_model environment's
    section (its policy keys converted as a policy's), its GPU comes off the policy's; what NeMo-RL's environment
    asserts is refused in one line each."""
    main, rows = FIXTURES / "main" / "grpo_rm_1B.yaml", [f"++data.train.data_path={FIXTURES / 'math.jsonl'}"]
    loaded = load_nemo_rl_config(main, rows)
    cfg, sources = loaded.config, loaded.conversion.sources
    section = cfg.env.backend_sections["reward_model_cfg"]
    assert cfg.env.name == "reward_model" and cfg.cluster.workers_per_node == 1  # gpus_per_node 2, one the RM's
    assert sources["cluster.workers_per_node"] == "cluster.gpus_per_node - env.reward_model.resources"
    assert section["model_name"] == section["policy"]["tokenizer"]["name"] == "Skywork/Skywork-Reward-V2-Qwen3-0.6B"
    assert (section["batch_size"], section["precision"], section["max_model_len"]) == (
        cfg.policy.train_micro_batch_size,
        "bfloat16",
        2048,
    )
    assert section["resources"] == {"workers_per_node": 1, "num_nodes": 1}
    assert section["policy"]["dtensor_cfg"]["tensor_parallel_size"] == 1
    assert section["policy"]["tokenizer"]["chat_template"] == "default"  # NeMo-RL's: the tokenizer's own
    ignored = dict(loaded.conversion.ignored)
    assert {"env.reward_model.reward_model_cfg", "env.reward_model.processor", "env.reward_model.max_grad_norm"} <= set(
        ignored
    )
    assert refusal(main, [*rows, "env.reward_model.reward_model_cfg.reward_model_type=regression"]) == [
        'env.reward_model.reward_model_cfg: is {"enabled": true, "reward_model_type": "regression"}; the '
        "reward-model environment scores with a Bradley-Terry reward model (the score at the last token): set "
        "enabled: true and reward_model_type: bradley_terry"
    ]
    [line] = refusal(main, [*rows, "env.reward_model.sequence_packing.enabled=true"])
    assert line.startswith("env.reward_model.sequence_packing.enabled: is true;") and "set it to false" in line
    [line] = refusal(main, [*rows, "env.reward_model.resources.gpus_per_node=2"])
    assert line.startswith("env.reward_model.resources: the reward model's 2 GPUs leave no GPU"), line
