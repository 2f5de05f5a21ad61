"""NeMo-RL algorithms rlcore does not run (reward-model training) are refused in one line that names the algorithm
and what to use instead, not in one "unknown key" line per key of their sections."""

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


def test_reward_model_training_is_refused_in_one_line() -> None:
    [line] = refusal(FIXTURES / "unsupported_main" / "rm.yaml")
    assert line.startswith("rm: NeMo-RL's reward-model training (a Bradley-Terry reward model")
    assert "not supported by rlcore yet; use a DPO config" in line


def test_a_grpo_section_beside_a_ppo_one_is_refused_as_two_algorithms() -> None:
    """A GRPO config that also carries a ``ppo`` section trains two algorithms: one line says so."""
    rows = FIXTURES / "math.jsonl"
    problems = refusal(
        FIXTURES / "main" / "grpo_math_1B.yaml", [f"++data.train.data_path={rows}", "++ppo.ppo_epochs=4"]
    )
    assert problems == ["grpo, ppo: a config trains one algorithm; keep one of the sections"], problems


def test_grpo_with_a_reward_model_environment_names_the_environment_not_unknown_keys() -> None:
    """grpo_rm_1B.yaml is GRPO scored by a reward model: refused for its environment, with the fix."""
    problems = refusal(FIXTURES / "main" / "grpo_rm_1B.yaml")
    assert not [line for line in problems if UNKNOWN in line], problems
    assert any(line.startswith("data.default.env_name: is 'reward_model'") for line in problems), problems
