"""The ``verifiers`` agent environment against a scripted OpenAI-compatible endpoint (no network, no model).

One module fixture plays three episodes of a single-turn verifiers taskset (tests/envs/rlv_quiz.py) concurrently on
one event loop, as rlcore's agent rollout does: verifiers' own chat program (a subprocess of this Python) talks to
the scripted endpoint, and the task's rubric scores. The rewards are checked against the rubric worked by hand.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import math
from typing import Any

import pytest
from rlv_scripted_openai import ScriptedEndpoint

from rlcore.interfaces.agent import AgentEnvironment, AgentOutcome, AgentSample, OpenAIEndpoint, is_agent_environment

QUESTION = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 2+2?"}]

# rollout id -> (the endpoint's script, the sample's metadata, the outcome the quiz rubric gives by hand:
# correct = the last reply equals the answer (weight 1); brief = at most 3 characters (weight 0.5))
EPISODES: dict[str, tuple[list[dict[str, Any]], dict[str, Any], AgentOutcome | None]] = {
    "right": (
        [{"content": "4"}],
        {"ground_truth": "4", "difficulty": 3},
        AgentOutcome(1.5, {"correct": 1.0, "brief": 0.5}),
    ),
    "brief_but_wrong": ([{"content": "5"}], {"ground_truth": "4"}, AgentOutcome(0.5, {"correct": 0.0, "brief": 0.5})),
    "refused": ([{"status": 400}], {"ground_truth": "4"}, None),  # the endpoint refuses the turn: an error outcome
}


def quiz_config(**overrides: Any) -> Any:
    from rl_verifiers.config import VerifiersConfig

    return VerifiersConfig(**{"environment": "rlv_quiz", **overrides})


def check_agent_environment(environment: Any, runs: list[tuple[AgentSample, AgentSample, Any]]) -> list[str]:
    """What rlcore's agent rollout relies on, checked on episodes already run: ``(sample before, sample after,
    outcome or raised)``. The environment kit (rlcore.testing.environment_kit) only knows ``step()``."""
    problems = []
    if not (is_agent_environment(environment) and isinstance(environment, AgentEnvironment)):
        problems.append("not an agent environment (no run_episode)")
    if not inspect.iscoroutinefunction(environment.run_episode):
        problems.append("run_episode is not a coroutine function")
    for before, after, result in runs:
        if not isinstance(result, AgentOutcome):
            problems.append(f"run_episode gave {type(result).__name__}, not an AgentOutcome (errors are outcomes)")
            continue
        if not math.isfinite(result.reward):
            problems.append(f"reward {result.reward} is not finite")
        if result.error is not None and result.reward != 0.0:
            problems.append("an errored episode has a reward")
        if result.reward_components is not None and not math.isclose(
            sum(result.reward_components.values()), result.reward, abs_tol=1e-9
        ):
            problems.append(f"components {result.reward_components} do not sum to the reward {result.reward}")
        if (before.messages, before.metadata, before.tools) != (after.messages, after.metadata, after.tools):
            problems.append("run_episode changed the sample it was given")
    return problems


@pytest.fixture(scope="module")
def quiz_runs(verifiers_subprocesses):
    from rl_verifiers.environment import VerifiersEnvironment

    environment = VerifiersEnvironment(quiz_config(max_tokens=16))
    samples = {name: AgentSample(copy.deepcopy(QUESTION), dict(meta)) for name, (_, meta, _) in EPISODES.items()}
    given = copy.deepcopy(samples)
    with ScriptedEndpoint() as endpoint:
        endpoint.scripts = {name: list(script) for name, (script, _, _) in EPISODES.items()}

        async def episodes() -> list[Any]:
            runs = (
                environment.run_episode(OpenAIEndpoint(endpoint.base_url(n), "policy"), s) for n, s in samples.items()
            )
            return await asyncio.gather(*runs, return_exceptions=True)

        results = dict(zip(samples, asyncio.run(episodes())))
    return environment, given, samples, results, endpoint.requests


def test_rewards_are_the_rubric_worked_by_hand(quiz_runs):
    _, _, _, results, _ = quiz_runs
    for name, (_, _, expected) in EPISODES.items():
        if expected is None:
            continue
        assert results[name] == expected, name


def test_a_refused_turn_is_an_error_outcome(quiz_runs):
    _, _, _, results, requests = quiz_runs
    refused = results["refused"]
    assert isinstance(refused, AgentOutcome) and refused.reward == 0.0
    assert refused.error is not None and "400" in refused.error and "scripted failure" in refused.error
    assert len(requests["refused"]) == 1  # a refused request is not retried


def test_every_turn_went_to_the_endpoint_as_the_run_samples(quiz_runs):
    """The prompt is the sample's messages; the model is the endpoint's; only max_tokens is forwarded; the
    endpoint sees whole-completion requests (verifiers' chat program streams: the bridge)."""
    _, _, _, _, requests = quiz_runs
    assert sorted(requests) == sorted(EPISODES)
    for name, sent in requests.items():
        assert len(sent) == 1, name
        assert sent[0] == {"messages": QUESTION, "model": "policy", "max_tokens": 16}, name


def test_agent_environment_conformance(quiz_runs):
    environment, given, samples, results, _ = quiz_runs
    runs = [(given[n], samples[n], results[n]) for n in EPISODES]
    assert check_agent_environment(environment, runs) == []


def test_metadata_fills_the_task_data(quiz_runs):
    environment = quiz_runs[0]
    env = environment._build()
    task = environment._task(env, AgentSample(QUESTION, {"ground_truth": "4", "difficulty": 3, "source": "x"}))
    assert task.data.prompt == [m for m in env.taskset.task_type().data_type()(prompt=QUESTION).prompt]
    assert (task.data.answer, task.data.difficulty) == ("4", 3)
    assert not hasattr(task.data, "source")


def test_the_plugin_registers_the_environment():
    from rlcore.plugins import get_registry

    registry = get_registry()
    spec = registry.resolve_environment("verifiers")
    assert spec.environment_class == "rl_verifiers.environment:VerifiersEnvironment"
    VerifiersConfig = spec.load_config_class()
    assert VerifiersConfig is type(quiz_config())
    assert [r.status for r in registry.environments() if r.name == "verifiers"] == ["ok"]
    with pytest.raises(ValueError, match="extra"):
        VerifiersConfig(environment="rlv_quiz", argz={})  # type: ignore[call-arg]


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


def test_a_function_may_build_the_env():
    from rl_verifiers.environment import VerifiersEnvironment

    VerifiersEnvironment(quiz_config(environment="rlv_quiz:build_env"))
    with pytest.raises(ValueError, match="the Env rlv_quiz:build_env returns: env.agent.runtime.type"):
        VerifiersEnvironment(
            quiz_config(environment="rlv_quiz:build_env", args={"agent": {"runtime": {"type": "docker"}}})
        )
