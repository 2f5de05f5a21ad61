"""The ``verifiers`` environment's registration, config checks and task building: no episode runs here (the
episodes are test_verifiers_rollout.py's, through rlcore's endpoint, and the slow test_verifiers_scripted.py's)."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import pytest

from rlcore.interfaces.agent import AgentEnvironment, AgentOutcome, AgentSample, OpenAIEndpoint, is_agent_environment

QUESTION = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 2+2?"}]


def quiz_config(**overrides: Any) -> Any:
    from rl_verifiers.config import VerifiersConfig

    return VerifiersConfig(**{"environment": "rlv_quiz", **overrides})


@pytest.fixture(scope="module")
def quiz():
    from rl_verifiers.environment import VerifiersEnvironment

    return VerifiersEnvironment(quiz_config())


def test_the_plugin_registers_an_agent_environment(quiz):
    from rlcore.plugins import get_registry

    registry = get_registry()
    spec = registry.resolve_environment("verifiers")
    assert spec.environment_class == "rl_verifiers.environment:VerifiersEnvironment"
    assert [r.status for r in registry.environments() if r.name == "verifiers"] == ["ok"]
    config_class = spec.load_config_class()
    assert config_class is type(quiz_config())
    with pytest.raises(ValueError, match="extra"):
        config_class(environment="rlv_quiz", argz={})  # a typo is an error, not a default
    assert is_agent_environment(quiz) and isinstance(quiz, AgentEnvironment)
    assert inspect.iscoroutinefunction(quiz.run_episode) and quiz.tools is None


def test_metadata_fills_the_task_data(quiz):
    env = quiz._build()
    task = quiz._task(env, AgentSample(QUESTION, {"ground_truth": "4", "difficulty": 3, "source": "x"}))
    assert task.data.prompt == type(task.data)(prompt=QUESTION).prompt
    assert (task.data.answer, task.data.difficulty) == ("4", 3)
    assert "source" not in type(task.data).model_fields
    unpassed = quiz_config(ground_truth_field=None)
    from rl_verifiers.environment import VerifiersEnvironment

    assert VerifiersEnvironment(unpassed)._task(env, AgentSample(QUESTION, {"ground_truth": "4"})).data.answer == ""


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"args": {"agent": {"model": "gpt-x"}}}, "env.verifiers_cfg.args.agent.model: every seat plays the policy"),
        ({"args": {"agent": {"sampling": {"temperature": 0.1}}}}, "env.verifiers_cfg.args.agent.sampling"),
        ({"args": {"agent": {"runtime": {"type": "docker"}}}}, "env.verifiers_cfg.args.agent.runtime.type: 'docker'"),
        ({"args": {"taskset": {"id": "gsm8k"}}}, "env.verifiers_cfg.args.taskset.id: 'gsm8k' differs"),
        ({"ground_truth_field": "solution"}, "env.verifiers_cfg.ground_truth_field: 'solution' is not a field"),
        ({"environment": "rlv_quiz:not_an_env"}, "returned dict, not a verifiers.v1 Env"),
    ],
)
def test_what_would_not_train_the_policy_is_refused(overrides, message):
    from rl_verifiers.environment import VerifiersEnvironment

    with pytest.raises((ValueError, TypeError)) as caught:
        VerifiersEnvironment(quiz_config(**overrides))
    assert message in str(caught.value)


def test_rlcore_defaults_each_seat_to_the_local_chat_harness_on_subprocess(quiz):
    env = quiz._build()
    assert env.config.agent.runtime.type == "subprocess"
    assert env.config.agent.harness.id == "rl_verifiers_harness"


def test_a_function_may_build_the_env():
    from rl_verifiers.environment import VerifiersEnvironment

    VerifiersEnvironment(quiz_config(environment="rlv_quiz:build_env"))
    with pytest.raises(ValueError, match="the Env rlv_quiz:build_env returns: env.agent.runtime.type"):
        VerifiersEnvironment(
            quiz_config(environment="rlv_quiz:build_env", args={"agent": {"runtime": {"type": "docker"}}})
        )


def test_max_concurrent_episodes_bounds_the_episodes_in_flight(quiz, monkeypatch):
    """Orchestration: the episode itself is a stand-in that records how many run at once."""
    from rl_verifiers.environment import VerifiersEnvironment

    environment = VerifiersEnvironment(quiz_config(max_concurrent_episodes=2))
    running, most = 0, 0

    async def play(endpoint: OpenAIEndpoint, sample: AgentSample) -> Any:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(0.01)
        running -= 1
        raise RuntimeError("stand-in")

    monkeypatch.setattr(environment, "_play", play)

    async def episodes() -> list[AgentOutcome]:
        sample = AgentSample(QUESTION, {})
        return await asyncio.gather(
            *(environment.run_episode(OpenAIEndpoint("http://x/v1", "m"), sample) for _ in range(5))
        )

    outcomes = asyncio.run(episodes())
    assert most == 2
    assert outcomes == [AgentOutcome(0.0, error="RuntimeError: stand-in")] * 5
