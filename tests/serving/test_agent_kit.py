"""The agent-environment kit on the built-in ``agent`` environment: a conforming agent passes, and agents that
break what the rollout relies on are each named (the kit's own negative controls)."""

from __future__ import annotations

import itertools

from rlcore.interfaces.agent import AgentSample, OpenAIEndpoint
from rlcore.testing.agent_kit import AgentCase, check_agent_environment

CASES = [
    AgentCase([{"role": "user", "content": "What is 2+2?"}], {"ground_truth": "4"}, ["let me think", "4"]),
    AgentCase([{"role": "user", "content": "What is 3+3?"}], {"ground_truth": "6"}, ["hmm", "7"]),
]
_calls = itertools.count()


async def asks_twice(endpoint: OpenAIEndpoint, sample: AgentSample) -> float:
    """Two turns through the endpoint; reward 1 when the last reply is the answer."""
    client = endpoint.async_client()
    messages = list(sample.messages)
    for _ in range(2):
        reply = await client.chat.completions.create(model=endpoint.model, messages=messages)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content}]
        messages += [{"role": "user", "content": "Sure?"}]
    return float(messages[-2]["content"].strip() == sample.metadata["ground_truth"])


async def answers_for_the_policy(endpoint: OpenAIEndpoint, sample: AgentSample) -> float:
    return 1.0


async def scores_by_call_count(endpoint: OpenAIEndpoint, sample: AgentSample) -> float:
    await asks_twice(endpoint, sample)
    return float(next(_calls))


def agent(function: str) -> tuple[str, dict[str, str]]:
    return "agent", {"function": f"{__name__}:{function}"}


def test_a_conforming_agent_passes_and_each_broken_contract_is_named() -> None:
    assert check_agent_environment(*agent("asks_twice"), CASES) == []
    assert check_agent_environment(*agent("answers_for_the_policy"), CASES) == [
        "case 0: the agent made no request to the endpoint",
        "case 1: the agent made no request to the endpoint",
    ]
    problems = check_agent_environment(*agent("scores_by_call_count"), CASES)
    assert "rolling out the same cases again gave different rewards" in problems
    assert check_agent_environment("digits", None, CASES) == [
        "rlcore.environments.digits:DigitsEnvironment is not an agent environment: it needs async def "
        "run_episode(self, endpoint, sample)"
    ]
