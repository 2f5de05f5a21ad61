"""The OpenAI-compatible endpoint and agent rollouts over a scripted engine (orchestration: the engine is a
stand-in; the HTTP server, the openai client, the chat template and the tool-call parser are real).

The reference for the trained token sequence is independent of the server's incremental encoding: the tiny byte
tokenizer's chat template renders the whole conversation (every assistant message as the text the engine wrote)
to the same ids, since every byte is one token and the template never changes an earlier turn.
"""

from __future__ import annotations

import json
import socket
import threading
from typing import Any

import openai
import pytest

from rlcore.config import load_config_dict
from rlcore.datasets import Sample
from rlcore.interfaces.agent import AgentOutcome, AgentSample, OpenAIEndpoint
from rlcore.run.agent_rollouts import run_agent_rollout
from rlcore.run.rollouts import sampling_seed
from rlcore.run.step import Timer
from rlcore.serving.server import PolicyServer
from rlcore.serving.service import ChatService, ServingSettings
from rlcore.testing.scripted_engine import ScriptedEngine

TOOLS: list[Any] = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
SCRIPTS = {
    "task-0": [CALL, '<tool_call>{"name": "add", oops</tool_call>', "so it is 3"],
    "task-1": ["hello", "again"],
}


def config(**generation: Any) -> Any:
    return load_config_dict(
        {
            "policy": {
                "backend": "reference",
                "model_name": "tiny-llama",
                "max_total_sequence_length": 512,
                "generation": {"backend": "vllm", "max_new_tokens": 128, **generation},
            },
            "grpo": {"seed": 5},
        }
    )


class ToolAgent:
    """Task 0: three turns, a tool message after each reply; task 1: rewrites its first message at turn 2."""

    tools = TOOLS

    def __init__(self) -> None:
        self.replies: dict[str, list[Any]] = {}

    async def run_episode(self, endpoint: OpenAIEndpoint, sample: AgentSample) -> AgentOutcome:
        task = sample.metadata["task"]
        replies = self.replies.setdefault(task, [])
        messages: list[Any] = [dict(m) for m in sample.messages]
        async with endpoint.async_client() as retrying:
            client = retrying.with_options(max_retries=0)  # a failed request fails the test, not a retry
            for turn in range(3 if task == "task-0" else 2):
                if task == "task-1" and turn == 1:
                    messages[0] = {**messages[0], "content": "rewritten"}
                reply = await client.chat.completions.create(
                    model=endpoint.model, messages=messages, tools=TOOLS, logprobs=True, temperature=1.0
                )
                replies.append(reply)
                message = reply.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                call_id = message.tool_calls[0].id if message.tool_calls else "none"
                messages.append({"role": "tool", "tool_call_id": call_id, "content": f"result {turn}"})
        assert sample.tools == TOOLS  # the environment's tools reach each sample
        return AgentOutcome(1.0, reward_components={"correct": 1.0})


def full_render(tokenizer: Any, sample: Sample, replies: list[Any]) -> list[int]:
    """The reference: the whole conversation through the chat template at once (the tiny template ignores tools)."""
    messages = [dict(m) for m in sample.messages]
    for turn, reply in enumerate(replies):
        messages.append({"role": "assistant", "content": tokenizer.decode(reply.choices[0].token_ids[:-1])})
        if turn < len(replies) - 1:
            messages.append({"role": "tool", "content": f"result {turn}"})
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    return tokenizer.encode(text.removesuffix("\n"), add_special_tokens=False)


def test_a_three_turn_tool_episode_trains_the_engine_tokens_and_a_rewritten_history_fails_its_episode(tiny_tokenizer):
    tokenizer = tiny_tokenizer
    engine, agent = ScriptedEngine(tokenizer, SCRIPTS, max_new_tokens=128), ToolAgent()
    samples = [Sample(7, [{"role": "user", "content": f"task-{i}: add"}], {"task": f"task-{i}"}) for i in range(2)]
    rollout = run_agent_rollout(config(), engine, agent, tokenizer, samples, 1, Timer())
    data, replies = rollout.data, agent.replies["task-0"]

    # turn by turn: each prompt continues the previous one, and the trained sequence is the template's whole render
    sequence = full_render(tokenizer, samples[0], replies)
    assert data["output_ids"][0, : len(sequence)].tolist() == sequence
    assert int(data["unpadded_sequence_lengths"][0]) == len(sequence)
    mask, spans = [0] * len(sequence), []
    for turn, reply in enumerate(replies):
        start, generated = len(reply.prompt_token_ids), reply.choices[0].token_ids
        assert sequence[start : start + len(generated)] == generated  # the engine's ids, as generated
        assert generated[-1] == tokenizer.eos_token_id
        if turn:  # the previous prompt and completion, as they were, then the tool message
            previous = replies[turn - 1]
            before = previous.prompt_token_ids + previous.choices[0].token_ids
            assert reply.prompt_token_ids[: len(before)] == before and len(reply.prompt_token_ids) > len(before)
        mask[start : start + len(generated)] = [1] * len(generated)
        spans.append((start, len(generated)))
        logprobs = [item.logprob for item in reply.choices[0].logprobs.content]
        assert logprobs == pytest.approx([-(k + 1) / 100 for k in range(len(generated))])
        assert data["logprobs"][0, start : start + len(generated)].tolist() == pytest.approx(logprobs)
    assert data["token_mask"][0, : len(sequence)].tolist() == mask  # the tool messages are context
    assert data["input_lengths"][0] == spans[0][0] and data["first_turn_lengths"][0] == spans[0][1]
    assert data["generation_lengths"][0] == sum(n for _, n in spans)

    # tool calls: parsed into OpenAI's shape; a malformed one flags its turn's tokens
    first = replies[0].choices[0]
    assert first.finish_reason == "tool_calls" and first.message.tool_calls[0].function.name == "add"
    assert json.loads(first.message.tool_calls[0].function.arguments) == {"a": 1, "b": 2}
    assert [r.choices[0].finish_reason for r in replies[1:]] == ["stop", "stop"]
    start, count = spans[1]
    assert data["invalid_tool_call_mask"][0].nonzero().flatten().tolist() == list(range(start, start + count))

    # seeds: the other path's, per data row, copy and turn; the run's weight version carried over
    seeds = [r["seed"] for r in engine.requests if "task-0" in tokenizer.decode(r["prompt"])]
    assert seeds == [sampling_seed(5, None, 7, 0, turn) for turn in range(3)]
    assert data["weight_version"].tolist() == [3, 3] and rollout.metrics["weight_version"] == 3

    # task 1 rewrote its history at turn 2: refused, the episode failed (reward 0), its first turn kept
    assert rollout.rewards.tolist() == [1.0, 0.0] and data["reward/correct"].tolist() == [1.0, 0.0]
    assert rollout.metrics["env/errors"] == 1.0
    assert "history was rewritten" in str(rollout.metrics["env/first_error"])
    assert "data row 7" in str(rollout.metrics["env/first_error"])
    assert len(agent.replies["task-1"]) == 1 and int(data["generation_lengths"][1]) == len(b"hello") + 1
    assert rollout.metrics["rollout/turns_mean"] == 2.0 and rollout.metrics["rollout/tool_calls_mean"] == 0.5
    assert not any(t.name == "rlcore-openai-endpoint" for t in threading.enumerate())


def test_the_endpoint_serves_what_it_says_and_refuses_the_rest(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, {"x": ["first", "second", "third"]}, max_new_tokens=64)
    settings = ServingSettings.from_config(config(top_p=0.9), pad_id=0)
    service = ChatService(engine, tiny_tokenizer, settings)
    with PolicyServer(service) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny-llama"]
        user = [{"role": "user", "content": "x"}]
        reply = client.chat.completions.create(model="tiny-llama", messages=user, top_p=0.9, max_tokens=3)
        assert reply.choices[0].message.content == "fir" and reply.choices[0].finish_reason == "length"
        assert reply.choices[0].token_ids == tiny_tokenizer.encode("fir", add_special_tokens=False)
        completion = client.completions.create(model="tiny-llama", prompt=[1, 123], stop=["!"], logprobs=0)
        assert completion.choices[0].text == "second" and completion.prompt_token_ids == [1, 123]
        assert completion.choices[0].logprobs.token_logprobs == pytest.approx([-k / 100 for k in range(1, 8)])
        assert engine.requests[-1]["stop_strings"] == [["!"]] and engine.requests[-1]["seed"] is None
        refusals = {
            "temperature": dict(temperature=0.5),
            "top_p": dict(top_p=1.0),
            "top_logprobs": dict(logprobs=True, top_logprobs=2),
            "tool_choice": dict(tools=TOOLS, tool_choice="required"),
            "'n'": dict(n=2),
            "seed": dict(seed=1),
            "best_of_all": dict(extra_body={"best_of_all": 1}),
        }
        for said, kwargs in refusals.items():
            with pytest.raises(openai.BadRequestError, match=said):
                client.chat.completions.create(model="tiny-llama", messages=user, **kwargs)
        with pytest.raises(openai.NotFoundError, match="serves 'tiny-llama'"):
            client.chat.completions.create(model="gpt-4o", messages=user)
        lost = openai.OpenAI(base_url=server.url_for("nobody"), api_key="k", max_retries=0)
        with pytest.raises(openai.NotFoundError, match="no rollout 'nobody'"):
            lost.chat.completions.create(model="tiny-llama", messages=user)
        port = server.port
    assert len(engine.requests) == 2  # nothing refused reached the engine
    assert not any(t.name == "rlcore-openai-endpoint" for t in threading.enumerate())
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        pass


def test_a_streamed_request_gets_the_whole_answer_as_events(tiny_tokenizer):
    """stream: true (as agent frameworks send it) is answered once the completion is whole: one chunk with the
    message and its tool calls, the usage chunk when asked for, [DONE]; the token ids ride on the chunk."""
    engine = ScriptedEngine(tiny_tokenizer, {"x": ["I add. " + CALL, "done"]}, max_new_tokens=128)
    service = ChatService(engine, tiny_tokenizer, ServingSettings.from_config(config(), pad_id=0))
    with PolicyServer(service) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0)
        user = [{"role": "user", "content": "x"}]
        chunks = list(
            client.chat.completions.create(
                model="tiny-llama", messages=user, tools=TOOLS, stream=True, stream_options={"include_usage": True}
            )
        )
        first, usage = chunks
        delta = first.choices[0].delta
        assert (delta.role, delta.content, first.choices[0].finish_reason) == ("assistant", "I add.", "tool_calls")
        (call,) = delta.tool_calls
        assert (call.index, call.function.name, json.loads(call.function.arguments)) == (0, "add", {"a": 1, "b": 2})
        generated = first.choices[0].token_ids
        assert tiny_tokenizer.decode(generated).startswith("I add. " + CALL)
        assert first.usage is None and usage.choices == [] and usage.usage.completion_tokens == len(generated)
        assert usage.usage.prompt_tokens == len(first.prompt_token_ids)

        (text,) = list(client.completions.create(model="tiny-llama", prompt=[1, 123], stream=True))
        assert (text.object, text.choices[0].text) == ("text_completion", "done")
        with pytest.raises(openai.BadRequestError, match="stream_options"):
            client.chat.completions.create(model="tiny-llama", messages=user, stream_options={"usage": True})
    assert len(engine.requests) == 2


def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_tokenize_gives_the_ids_a_chat_request_prompts_with_and_detokenize_inverts(tiny_tokenizer):
    """vLLM's /tokenize and /detokenize, which agent harnesses (NeMo-Gym's) use to align tokens: the reference is
    the prompt_token_ids the chat request itself reports for the same conversation and tools."""
    engine = ScriptedEngine(tiny_tokenizer, {"x": ["first"]}, max_new_tokens=64)
    service = ChatService(engine, tiny_tokenizer, ServingSettings.from_config(config(), pad_id=0))
    with PolicyServer(service) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0)
        user = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "x"}]
        reply = client.chat.completions.create(model="tiny-llama", messages=user, tools=TOOLS)
        root = server.base_url.removesuffix("/v1")
        status, tokens = post(f"{root}/tokenize", {"model": "tiny-llama", "messages": user, "tools": TOOLS})
        assert status == 200 and tokens["tokens"] == reply.prompt_token_ids
        assert (tokens["count"], tokens["max_model_len"], tokens["token_strs"]) == (len(tokens["tokens"]), 512, None)
        status, text = post(f"{server.url_for('any')}/tokenize", {"prompt": "hi", "return_token_strs": True})
        assert status == 200 and text["tokens"] == tiny_tokenizer("hi")["input_ids"]  # v1 alias, rollout prefix
        assert text["token_strs"] == tiny_tokenizer.convert_ids_to_tokens(text["tokens"])
        status, back = post(f"{root}/detokenize", {"tokens": reply.choices[0].token_ids})
        assert status == 200 and back["prompt"] == tiny_tokenizer.decode(reply.choices[0].token_ids)
        refused = {
            "chat_template_kwargs": {"messages": user, "chat_template_kwargs": {"enable_thinking": True}},
            "required_prefix_token_ids": {"messages": user, "required_prefix_token_ids": [1]},
            "not both or neither": {"messages": user, "prompt": "x"},
        }
        for said, body in refused.items():
            status, error = post(f"{root}/tokenize", body)
            assert status == 400 and said in error["error"]["message"], error
    assert len(engine.requests) == 1  # tokenizing generates nothing


def test_a_backend_that_does_not_serve_continuously_is_refused_naming_the_fix(tiny_tokenizer):
    class Batches:  # a whole-batch engine
        continuous_serving = False

    with pytest.raises(ValueError, match=r"policy.generation.vllm_cfg.async_engine: true"):
        run_agent_rollout(config(), Batches(), ToolAgent(), tiny_tokenizer, [Sample(0, [], {})], 1, Timer())

    class Blocking:  # run_episode must be a coroutine function: the episodes share one event loop
        def run_episode(self, endpoint: OpenAIEndpoint, sample: AgentSample) -> AgentOutcome:
            return AgentOutcome(1.0)

    engine = ScriptedEngine(tiny_tokenizer, {})
    with pytest.raises(TypeError, match="Blocking.run_episode is not an async function"):
        run_agent_rollout(config(), engine, Blocking(), tiny_tokenizer, [Sample(0, [], {})], 1, Timer())
