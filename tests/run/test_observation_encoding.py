"""Observations in a multi-turn rollout: a chat role (or a list of ``messages``) goes through the chat template
after the generated turn, ``environment`` stays raw; the trajectory holds the generated ids as generated (a
template that trims would re-encode them differently); the environment's tools reach the first prompt; the
turns an environment flags for a malformed tool call are marked in ``invalid_tool_call_mask``. A scripted
generation stand-in: the rollout's bookkeeping is what is tested."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from rlcore.chat.templates import appended_ids, prompt_ids
from rlcore.datasets import Sample
from rlcore.interfaces.environment import EnvironmentReturn
from rlcore.run.rollouts import run_rollout
from rlcore.run.step import Timer
from tests.chat.test_templates import CALL, TOOL_RESULTS, TOOLS
from tests.chat.tokenizers import llama3_style_tokenizer, qwen_style_tokenizer


class ScriptedGeneration:
    """Turn t of every row generates ``texts[t]`` then the EOS (or not, where ``ended[t]`` is False), logprob -1."""

    def __init__(self, tokenizer: Any, texts: list[str], ended: list[bool] | None = None) -> None:
        self.tokenizer, self.texts, self.ended = tokenizer, texts, ended or [True] * len(texts)
        self.requests: list[list[list[int]]] = []

    def ids(self, turn: int) -> list[int]:
        eos = [self.tokenizer.eos_token_id] if self.ended[turn] else []
        return self.tokenizer.encode(self.texts[turn], add_special_tokens=False) + eos

    def __call__(self, batch: Any) -> dict[str, Any]:
        lengths = batch["input_lengths"]
        self.requests.append([batch["input_ids"][r, : int(n)].tolist() for r, n in enumerate(lengths)])
        new = self.ids(len(self.requests) - 1)
        rows = len(lengths)
        out = torch.zeros(rows, int(lengths.max()) + len(new), dtype=torch.long)
        logprobs = torch.zeros(out.shape)
        for r in range(rows):
            n = int(lengths[r])
            out[r, :n] = batch["input_ids"][r, :n]
            out[r, n : n + len(new)] = torch.tensor(new)
            logprobs[r, n : n + len(new)] = -1.0
        return {
            "output_ids": out,
            "logprobs": logprobs,
            "generation_lengths": torch.full((rows,), len(new)),
            "unpadded_sequence_lengths": lengths + len(new),
            "truncated": torch.zeros(rows, dtype=torch.bool),
        }


class ScriptedEnvironment:
    """Answers turn t of every sample with ``observations[t]`` (the last turn ends the episode), flagging the
    turns in ``invalid`` as holding a malformed tool call; keeps the logs it saw."""

    def __init__(
        self, observations: list[dict[str, Any]], invalid: set[int] = frozenset(), tools: list | None = None
    ) -> None:
        self.observations, self.invalid, self.tools = observations, invalid, tools
        self.logs: list[list[dict[str, Any]]] = []

    def step(self, logs: list, metadata: list) -> EnvironmentReturn:
        turn = len(self.logs)
        self.logs.append([dict(m) for m in logs[0]])
        n, done = len(logs), turn == len(self.observations)
        observation = self.observations[turn] if not done else {"role": "environment", "content": ""}
        return EnvironmentReturn(
            [observation] * n,
            list(metadata),
            [1.0] * n,
            [done] * n,
            invalid_tool_calls=[turn in self.invalid] * n,
            metrics={"tool_calls": [1.0] * n, "invalid_tool_calls": [float(turn in self.invalid)] * n},
        )


def _cfg(turns: int) -> Any:
    return SimpleNamespace(
        algorithm_section=SimpleNamespace(max_rollout_turns=turns),
        policy=SimpleNamespace(max_total_sequence_length=1024, tokenizer=SimpleNamespace(chat_template_kwargs={})),
    )


FIRST = [{"role": "user", "content": "Weather in Paris?"}]


def test_tool_messages_go_through_the_template_with_the_environments_tools_and_flagged_turns_are_marked() -> None:
    tokenizer = qwen_style_tokenizer()
    texts = [f"Checking.\n{CALL}", "<tool_call>{oops</tool_call>", "Sunny."]
    engine = ScriptedGeneration(tokenizer, texts, ended=[True, False, True])  # turn 2 cut before its EOS
    env = ScriptedEnvironment(
        [
            {"role": "tool", "content": "", "messages": TOOL_RESULTS},
            {"role": "user", "content": "Fix that call."},
        ],
        invalid={1},
        tools=TOOLS,
    )
    rollout = run_rollout(_cfg(3), engine, env, tokenizer, [Sample(0, FIRST, {})], 1, Timer())
    first = prompt_ids(tokenizer, FIRST, tools=TOOLS)
    t0, t1, t2 = (engine.ids(t) for t in range(3))
    obs0 = appended_ids(tokenizer, TOOL_RESULTS, tools=TOOLS, completion_ids=t0)
    obs1 = appended_ids(tokenizer, [{"role": "user", "content": "Fix that call."}], tools=TOOLS, completion_ids=t1)
    expected = first + t0 + obs0 + t1 + obs1 + t2
    data = rollout.data
    assert data["output_ids"][0].tolist() == expected
    # the independent reference: the whole conversation as the template renders it (turn 2's cut closed by it)
    conversation = [*FIRST, {"role": "assistant", "content": texts[0]}, *TOOL_RESULTS]
    conversation += [{"role": "assistant", "content": texts[1]}, {"role": "user", "content": "Fix that call."}]
    assert expected[: -len(t2)] == prompt_ids(tokenizer, conversation, tools=TOOLS)
    generated = [0] * len(first) + [1] * len(t0) + [0] * len(obs0) + [1] * len(t1) + [0] * len(obs1) + [1] * len(t2)
    assert data["token_mask"][0].tolist() == generated
    flagged = [0] * (len(first) + len(t0) + len(obs0)) + [1] * len(t1) + [0] * (len(obs1) + len(t2))
    assert data["invalid_tool_call_mask"][0].tolist() == flagged and data["invalid_tool_call_mask"].dtype == torch.bool
    # the log keeps the observation's messages with their roles, ids and names
    log = env.logs[2]
    assert [m["role"] for m in log] == ["user", "assistant", "tool", "tool", "assistant", "user", "assistant"]
    assert [(m["tool_call_id"], m["name"]) for m in log[2:4]] == [("call_1", "get_weather"), ("call_2", "get_weather")]
    assert log[1]["content"] == texts[0]
    # the environment's per-turn numbers, summed over each sample's 3 turns
    assert (
        rollout.metrics["env/tool_calls_per_sample"] == 3.0
        and rollout.metrics["env/invalid_tool_calls_per_sample"] == 1.0
    )
    assert rollout.metrics["env/valid_tool_calls_rate"] == 1 - 1 / 3


def test_the_rollout_trains_on_the_generated_ids_where_re_encoding_the_text_would_change_them() -> None:
    tokenizer = llama3_style_tokenizer()  # trims every message's content
    engine = ScriptedGeneration(tokenizer, ["  4 \n", "  5"])
    env = ScriptedEnvironment([{"role": "user", "content": "And 2+3?"}])
    rollout = run_rollout(_cfg(2), engine, env, tokenizer, [Sample(0, FIRST, {})], 1, Timer())
    t0, t1 = engine.ids(0), engine.ids(1)
    obs = appended_ids(tokenizer, [{"role": "user", "content": "And 2+3?"}], completion_ids=t0)
    ids = rollout.data["output_ids"][0].tolist()
    assert ids == prompt_ids(tokenizer, FIRST) + t0 + obs + t1
    assert engine.requests[1] == [prompt_ids(tokenizer, FIRST) + t0 + obs]  # turn 2 generated from these very ids
    log = env.logs[1]
    re_encoded = prompt_ids(tokenizer, log[:3])  # the decoded conversation, rendered again
    assert re_encoded != ids[: len(re_encoded)]
    assert tokenizer.decode(re_encoded).count("  4 \n") == 0 and tokenizer.decode(ids).count("  4 \n") == 1
    assert not rollout.data["invalid_tool_call_mask"].any()


def test_an_environment_role_observation_is_its_content_tokenized_raw() -> None:
    tokenizer = qwen_style_tokenizer()
    engine = ScriptedGeneration(tokenizer, ["7", "8"])
    raw = "<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"
    env = ScriptedEnvironment([{"role": "environment", "content": raw}])
    rollout = run_rollout(_cfg(2), engine, env, tokenizer, [Sample(0, FIRST, {})], 1, Timer())
    expected = prompt_ids(tokenizer, FIRST) + engine.ids(0) + tokenizer.encode(raw, add_special_tokens=False)
    assert rollout.data["output_ids"][0].tolist() == expected + engine.ids(1)
    assert env.logs[1][2] == {"role": "environment", "content": raw}
