"""What turns the endpoint on and what refuses it, and the built-in ``agent`` environment's function contract."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest

from rlcore.config import load_config_dict, resolve
from rlcore.interfaces.agent import AgentEnvironment, AgentOutcome, AgentSample, OpenAIEndpoint, is_agent_environment
from rlcore.serving.agent_environment import AgentFunctionConfig, AgentFunctionEnvironment
from rlcore.serving.checks import serving_problems
from rlcore.serving.server import exposed_endpoint
from rlcore.testing.scripted_engine import ScriptedEngine


def run_config(backend: str, generation: str, **settings: Any) -> Any:
    return load_config_dict(
        {
            "policy": {
                "backend": backend,
                "model_name": "tiny-llama",
                "generation": {"backend": generation, **settings},
            }
        }
    )


def test_a_backend_that_cannot_serve_continuously_is_refused_before_the_run_and_one_that_can_is_not():
    refused = serving_problems(resolve(run_config("fsdp1", "fsdp1", expose_http_server=True)))
    assert refused == [
        "policy.generation.expose_http_server: is true, but the 'fsdp1' training backend generates itself, one "
        "batch at a time; use a backend that does (rl-vllm with policy.generation.vllm_cfg.async_engine: true)"
    ]
    assert serving_problems(resolve(run_config("fsdp1", "fsdp1"))) == []  # not served: nothing to refuse
    assert serving_problems(resolve(run_config("reference", "vllm", expose_http_server=True))) == []
    unknown = run_config("reference", "vllm", expose_http_server=True, tool_call_parser="hermes2")
    (line,) = serving_problems(resolve(unknown))
    assert line.startswith("policy.generation.tool_call_parser: no tool-call parser named 'hermes2' (installed: ")
    assert "hermes" in line.partition("installed: ")[2]


def test_expose_http_server_serves_the_policy_for_the_block_and_only_when_set(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, {"x": ["served"]})
    with exposed_endpoint(run_config("reference", "vllm"), engine, tiny_tokenizer, 0) as server:
        assert server is None
    with exposed_endpoint(run_config("reference", "vllm", expose_http_server=True), engine, tiny_tokenizer, 0) as on:
        assert on is not None and on.host == "127.0.0.1"
        client = openai.OpenAI(base_url=on.base_url, api_key="k", max_retries=0)
        reply = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "x"}])
        assert reply.choices[0].message.content == "served"
    with pytest.raises(ValueError, match="vllm_cfg.async_engine: true"):
        with exposed_endpoint(run_config("reference", "vllm", expose_http_server=True), object(), tiny_tokenizer, 0):
            pass


async def scored(endpoint: OpenAIEndpoint, sample: AgentSample, bonus: float = 0.0) -> float:
    return len(sample.messages) + bonus


async def wrong(endpoint: OpenAIEndpoint, sample: AgentSample) -> str:
    return "high"


def blocking(endpoint: OpenAIEndpoint, sample: AgentSample) -> float:
    return 1.0


def test_the_agent_environment_awaits_its_function_and_takes_a_float_or_an_outcome():
    env = AgentFunctionEnvironment(
        AgentFunctionConfig(function=f"{__name__}:scored", kwargs={"bonus": 0.5}, tools=[{"type": "function"}])
    )
    assert isinstance(env, AgentEnvironment) and is_agent_environment(env) and env.tools == [{"type": "function"}]
    endpoint = OpenAIEndpoint("http://127.0.0.1:1/rollouts/r/v1", "m")
    sample = AgentSample([{"role": "user", "content": "q"}], {})
    assert asyncio.run(env.run_episode(endpoint, sample)) == AgentOutcome(1.5)
    with pytest.raises(TypeError, match="returned str"):
        asyncio.run(
            AgentFunctionEnvironment(AgentFunctionConfig(function=f"{__name__}:wrong")).run_episode(endpoint, sample)
        )
    with pytest.raises(TypeError, match="env.agent_cfg.function: .* is not an async function"):
        AgentFunctionEnvironment(AgentFunctionConfig(function=f"{__name__}:blocking"))
