"""The grpo_tools_tiny example: its task (questions, the warm start's demonstrations) against independent
arithmetic, the hermes parser and the calculator; the two configs resolve and pass the preflight; the warm start's
conversations encode as the rollout's turns do; and (slow) the warm start then GRPO, whose tool calls run."""

from __future__ import annotations

import json
import random

import pytest

from rlcore.config import load_config, resolve
from rlcore.environments.tools_tasks import (
    KINDS,
    calculator_demonstrations,
    calculator_questions,
    demonstration,
    tool_call_text,
)
from rlcore.examples import example_path

#: The GRPO example over the built tiny model instead of the warm start's checkpoint (which a test has not made).
UNTRAINED = ["policy.warm_start=null", "policy.model_name=tiny-llama"]


def operands(prompt: str) -> tuple[int, int]:
    a, b = prompt.removeprefix("compute ").split("*")
    return int(a), int(b)


def test_questions_are_3_digit_products_with_their_product_as_answer():
    rows = calculator_questions(step=3, n=200, seed=1)
    assert rows == calculator_questions(step=3, n=200, seed=1) != calculator_questions(step=4, n=200, seed=1)
    for row in rows:
        a, b = operands(row["input"])
        assert 100 <= a <= 999 and 100 <= b <= 999 and row["output"] == str(a * b)
    assert len({row["output"] for row in rows}) > 190  # no answer to memorise


def test_demonstrations_call_the_calculator_as_the_parser_and_the_tool_read_them():
    from rlcore.chat.tool_calls import get_tool_call_parser
    from rlcore.tools.calculator import calculator

    parser = get_tool_call_parser("hermes")
    rng = random.Random(0)
    for kind in KINDS:
        for _ in range(20):
            a, b = rng.randint(100, 999), rng.randint(100, 999)
            messages = demonstration(a, b, kind, rng)
            assert messages[0] == {"role": "user", "content": f"compute {a}*{b}"}
            parsed = parser.parse(messages[1]["content"])
            if kind == "no_tool":
                assert not parsed.calls and not parsed.invalid and len(messages) == 2
                assert messages[1]["content"] != str(a * b)
            elif kind == "malformed_call":
                assert not parsed.calls and parsed.invalid and len(messages) == 2
            else:
                (call,) = parsed.calls
                assert call.name == "calculator" and not parsed.invalid
                result = calculator(**call.arguments)  # the tool the environment runs
                assert [m["role"] for m in messages[2:]] == ["tool", "assistant"]
                assert messages[2]["content"] == messages[3]["content"] == result
                assert (result == str(a * b)) == (kind == "correct")
    rows = calculator_demonstrations(step=0, n=1000, seed=0, flawed=0.3)
    correct = sum(row["messages"][1]["content"] == tool_call_text(row["messages"][0]["content"][8:]) for row in rows)
    assert 0.65 < correct / 1000 < 0.75


def test_a_demonstration_encodes_as_the_rollout_appends_its_turns():
    """The warm start trains on the token sequence a rollout builds: the prompt, the call and its EOS as generated,
    then the tool message through rlcore.chat.templates.appended_ids."""
    from rlcore.chat.templates import appended_ids, prompt_ids
    from rlcore.models.tokenizer import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    user, call, tool, answer = demonstration(123, 456, "correct", random.Random(0))
    completion = [*tokenizer.encode(call["content"], add_special_tokens=False), tokenizer.eos_token_id]
    rollout = [*prompt_ids(tokenizer, [user]), *completion, *appended_ids(tokenizer, [tool], completion_ids=completion)]
    whole = tokenizer.apply_chat_template([user, call, tool], add_generation_prompt=True, tokenize=False)
    assert rollout == tokenizer.encode(whole, add_special_tokens=False)
    assert tool["content"] == answer["content"] == "56088"


def test_both_configs_resolve_and_pass_the_preflight(tmp_path, monkeypatch):
    from rlcore.preflight import preflight, problem_lines

    monkeypatch.chdir(tmp_path)  # no runs/ here: the warm start has not run
    sft = resolve(load_config(example_path("grpo_tools_tiny_sft")), run=True)
    assert sft.config.algorithm == "sft" and problem_lines(preflight(sft)) == []

    grpo = resolve(load_config(example_path("grpo_tools_tiny"), UNTRAINED), run=True)
    assert grpo.generation is not None and grpo.config.grpo.max_rollout_turns >= 2
    assert grpo.config.env.name == "tools" and problem_lines(preflight(grpo)) == []

    # as shipped it starts from the warm start's last checkpoint, which rlcore run makes first
    as_shipped = resolve(load_config(example_path("grpo_tools_tiny")), run=True)
    assert as_shipped.config.policy.warm_start == "grpo_tools_tiny_sft"
    assert any("'grpo_tools_tiny_sft' has not finished" in notice for notice in as_shipped.notices)


@pytest.mark.slow
def test_one_command_runs_the_warm_start_then_grpo_which_calls_the_calculator(tmp_path):
    """A few minutes on 2 CPU cores: ``rlcore run`` on the GRPO example (4 steps) runs its warm start (200 SFT
    steps) first, then GRPO from the warm start's last checkpoint, whose calls run in a sandbox."""
    import subprocess
    import sys

    import yaml

    sft_dir, grpo_dir = tmp_path / "sft", tmp_path / "grpo"
    sft = yaml.safe_load(example_path("grpo_tools_tiny_sft").read_text())
    sft["logger"] = {**sft["logger"], "output_dir": str(sft_dir), "progress_bar": False}
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(sft))
    grpo = yaml.safe_load(example_path("grpo_tools_tiny").read_text())
    grpo["policy"]["warm_start"] = str(tmp_path / "sft.yaml")
    grpo["grpo"]["max_num_steps"] = 4
    grpo["logger"] = {**grpo["logger"], "output_dir": str(grpo_dir), "progress_bar": False}
    grpo["checkpointing"] = {"enabled": False}
    (tmp_path / "grpo.yaml").write_text(yaml.safe_dump(grpo))
    done = subprocess.run([sys.executable, "-m", "rlcore", "run", str(tmp_path / "grpo.yaml")], cwd=tmp_path)
    assert done.returncode == 0
    steps = sft["sft"]["max_num_steps"]
    summary = json.loads((sft_dir / "summary.json").read_text())
    assert summary["final_weights"] == str(sft_dir / "checkpoints" / f"step_{steps - 1:06d}" / "weights")
    rows = [json.loads(line) for line in (grpo_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    # the warm start calls the tool in most first turns, so most episodes take a second turn after a tool message
    assert rows[0]["rollout/turns_mean"] > 1.3, rows[0]
    # the tool messages are context: on the weights that sampled them the trainer scores the generated tokens of
    # every turn as the engine did (a tool token counted as generated, or a shifted turn, would be far off)
    assert abs(rows[0]["token_mult_prob_error"] - 1) < 1e-3, rows[0]
