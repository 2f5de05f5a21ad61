"""The ``verifiers`` agent environment against a scripted OpenAI-compatible endpoint (stdlib, no model), slow.

One module fixture plays four episodes concurrently on one event loop, as rlcore's agent rollout does: three of a
single-turn taskset (tests/envs/rlv_quiz.py) and one of a tool taskset (tests/envs/rlv_calc.py, a local MCP tool
server). verifiers' own chat program (a subprocess of this Python) talks to the scripted endpoint, which answers whole
completions and refuses streaming as rlcore's does; the task's rubric scores. The rewards are checked against the
rubric worked by hand; the requests against what the episode must have sent.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import math
from typing import Any

import pytest
from rlv_scripted_openai import ScriptedEndpoint, tool_call

from rlcore.interfaces.agent import AgentEnvironment, AgentOutcome, AgentSample, OpenAIEndpoint, is_agent_environment

pytestmark = pytest.mark.slow  # about 10 s of CPU: five subprocesses (four chat programs, a tool server)

QUESTION = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 2+2?"}]
CALC_QUESTION = [{"role": "user", "content": "What is 17+25? Use the tool."}]

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
    calc = VerifiersEnvironment(quiz_config(environment="rlv_calc"))
    samples = {name: AgentSample(copy.deepcopy(QUESTION), dict(meta)) for name, (_, meta, _) in EPISODES.items()}
    samples["calc"] = AgentSample(copy.deepcopy(CALC_QUESTION), {"ground_truth": "42"})
    given = copy.deepcopy(samples)
    with ScriptedEndpoint() as endpoint:
        endpoint.scripts = {name: list(script) for name, (script, _, _) in EPISODES.items()}
        endpoint.scripts["calc"] = [tool_call("calculator_add", {"a": 17, "b": 25}), {"content": "17+25 = 42"}]

        async def episodes() -> list[Any]:
            runs = (
                (calc if n == "calc" else environment).run_episode(OpenAIEndpoint(endpoint.base_url(n), "policy"), s)
                for n, s in samples.items()
            )
            return await asyncio.gather(*runs, return_exceptions=True)

        results = dict(zip(samples, asyncio.run(episodes())))
    return environment, given, samples, results, endpoint.requests


def test_a_tool_episode_runs_the_local_tool_and_scores_it(quiz_runs):
    """The model called calculator_add(17, 25); the tool server answered 42 as a tool message; the reply names 42:
    correct (weight 1) and used_tool (weight 0.25)."""
    _, _, _, results, requests = quiz_runs
    assert results["calc"] == AgentOutcome(1.25, {"correct": 1.0, "used_tool": 0.25})
    first, second = requests["calc"]
    assert [t["function"]["name"] for t in first["tools"]] == ["calculator_add"]
    assert second["messages"][:1] == CALC_QUESTION
    assert second["messages"][2] == {
        "role": "tool",
        "tool_call_id": "call_0",
        "content": "42",
        "name": "calculator_add",
    }
    assert second["tools"] == first["tools"]


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
    assert sorted(requests) == sorted([*EPISODES, "calc"])
    for name, sent in requests.items():
        if name == "calc":
            continue
        assert len(sent) == 1, name
        assert sent[0] == {"messages": QUESTION, "model": "policy", "max_tokens": 16}, name


def test_agent_environment_conformance(quiz_runs):
    environment, given, samples, results, _ = quiz_runs
    runs = [(given[n], samples[n], results[n]) for n in samples]
    assert check_agent_environment(environment, runs) == []
