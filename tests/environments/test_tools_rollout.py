"""The tools environment inside a rollout (the run's EnvironmentRunner, a Qwen2.5-style chat template, a scripted
generation stand-in): its tools reach the first prompt, the calculator's result comes back as a tool message
through the template, a malformed call's turn is marked in invalid_tool_call_mask, and the answer is graded."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from rlcore.chat.templates import prompt_ids
from rlcore.datasets import Sample
from rlcore.environments.runner import EnvironmentRunner
from rlcore.environments.tools_config import ToolsConfig
from rlcore.run.rollouts import run_rollout
from rlcore.run.step import Timer
from tests.chat.tokenizers import qwen_style_tokenizer

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "347*589"}}\n</tool_call>'
BROKEN = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "347*589"}\n</tool_call>'


class ScriptedGeneration:
    """Row r at turn t generates ``texts[r][t]`` and the EOS (a stand-in: the rollout's bookkeeping is tested)."""

    def __init__(self, tokenizer: Any, texts: list[list[str]]) -> None:
        self.tokenizer, self.texts, self.turn = tokenizer, texts, 0
        self.rows: list[int] = []

    def __call__(self, batch: Any) -> dict[str, Any]:
        lengths = batch["input_lengths"]
        active = [r for r in range(len(self.texts)) if len(self.texts[r]) > self.turn]
        new = [
            self.tokenizer.encode(self.texts[r][self.turn], add_special_tokens=False) + [self.tokenizer.eos_token_id]
            for r in active
        ]
        self.turn += 1
        out = torch.zeros(len(active), int(lengths.max()) + max(map(len, new)), dtype=torch.long)
        logprobs = torch.zeros(out.shape)
        for row, ids in enumerate(new):
            n = int(lengths[row])
            out[row, :n] = batch["input_ids"][row, :n]
            out[row, n : n + len(ids)] = torch.tensor(ids)
            logprobs[row, n : n + len(ids)] = -1.0
        return {
            "output_ids": out,
            "logprobs": logprobs,
            "generation_lengths": torch.tensor([len(ids) for ids in new]),
            "unpadded_sequence_lengths": lengths + torch.tensor([len(ids) for ids in new]),
            "truncated": torch.zeros(len(active), dtype=torch.bool),
        }


def test_a_tool_episode_in_a_rollout():
    tokenizer = qwen_style_tokenizer()
    runner = EnvironmentRunner(
        "tools",
        "rlcore.environments.tools:ToolsEnvironment",
        ToolsConfig(tools=["calculator"], verifier="builtin"),
    )
    try:
        engine = ScriptedGeneration(
            tokenizer,
            [
                [CALL, "The answer is 204383."],
                [BROKEN, "The answer is 204000."],
            ],  # right after a call; wrong after a broken one
        )
        first = [{"role": "user", "content": "compute 347*589"}]
        cfg = SimpleNamespace(
            algorithm_section=SimpleNamespace(max_rollout_turns=3),
            policy=SimpleNamespace(max_total_sequence_length=2048, tokenizer=SimpleNamespace(chat_template_kwargs={})),
        )
        rollout = run_rollout(
            cfg, engine, runner, tokenizer, [Sample(0, first, {"ground_truth": "204383"})] * 2, 1, Timer()
        )
    finally:
        runner.shutdown()
    assert rollout.rewards.tolist() == [1.0, 0.0]
    data = rollout.data
    # the independent reference: the whole episode as the template renders it, tools in the system turn
    tools = runner.tools
    assert [t["function"]["name"] for t in tools] == ["calculator"]
    answered = [{"role": "tool", "content": "204383", "tool_call_id": "x", "name": "calculator"}]
    episode = [*first, {"role": "assistant", "content": CALL}, *answered]
    rendered = prompt_ids(tokenizer, episode, tools=tools)
    final = tokenizer.encode("The answer is 204383.", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert data["output_ids"][0, : int(data["unpadded_sequence_lengths"][0])].tolist() == rendered + final
    assert tokenizer.decode(rendered).count("<tool_response>\n204383\n</tool_response>") == 1
    # the broken call's turn, and only it, is marked; the malformed call was answered with an error the model saw
    flagged = data["invalid_tool_call_mask"]
    assert flagged[0].sum() == 0
    broken = tokenizer.encode(BROKEN, add_special_tokens=False) + [tokenizer.eos_token_id]
    start = len(prompt_ids(tokenizer, first, tools=tools))
    assert flagged[1].nonzero().flatten().tolist() == list(range(start, start + len(broken)))
    assert "error: malformed tool call" in tokenizer.decode(data["output_ids"][1].tolist())
