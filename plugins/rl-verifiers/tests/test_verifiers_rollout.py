"""A verifiers taskset rolled out through rlcore's own endpoint (``run_agent_rollout``) over a scripted engine.

Orchestration only in the engine (the scripted stand-in of tests/serving answers each prompt from a script); the
endpoint, the tiny byte tokenizer's chat template, verifiers' chat program and interception server, the stream
bridge and the rubric are real. Checked: the rewards and their components (the quiz rubric worked by hand), and
that the trained tokens are the template's prompt followed by the engine's ids.
"""

from __future__ import annotations

from typing import Any

import pytest

from rlcore.config import load_config_dict
from rlcore.datasets import Sample
from rlcore.run.agent_rollouts import run_agent_rollout
from rlcore.run.step import Timer
from rlcore.testing.scripted_engine import ScriptedEngine

# marker -> (the engine's reply, metadata, reward by hand: correct (w 1) = the reply is the answer, brief (w 0.5) =
# at most 3 characters)
ROWS: dict[str, tuple[str | None, dict[str, Any], float]] = {
    "task-0": ("4", {"ground_truth": "4", "difficulty": 2}, 1.5),
    "task-1": ("5", {"ground_truth": "4"}, 0.5),
    "task-2": (None, {"ground_truth": "4", "difficulty": "hard"}, 0.0),  # not the task data's int: an error
}


@pytest.fixture(scope="module")
def rollout(verifiers_subprocesses, tiny_tokenizer):
    from rl_verifiers.config import VerifiersConfig
    from rl_verifiers.environment import VerifiersEnvironment

    cfg = load_config_dict(
        {
            "policy": {
                "backend": "reference",
                "model_name": "tiny-llama",
                "max_total_sequence_length": 256,
                "generation": {"backend": "vllm", "max_new_tokens": 16},
            },
            "grpo": {"seed": 5},
        }
    )
    scripts = {marker: [reply] for marker, (reply, _, _) in ROWS.items() if reply is not None}
    engine = ScriptedEngine(tiny_tokenizer, scripts, max_new_tokens=16)
    samples = [
        Sample(i, [{"role": "user", "content": f"{marker}: What is 2+2?"}], meta)
        for i, (marker, (_, meta, _)) in enumerate(ROWS.items())
    ]
    environment = VerifiersEnvironment(VerifiersConfig(environment="rlv_quiz"))
    return run_agent_rollout(cfg, engine, environment, tiny_tokenizer, samples, 1, Timer()), samples, engine


def test_rewards_and_components_are_the_rubric_worked_by_hand(rollout):
    result, _, _ = rollout
    assert result.rewards.tolist() == [reward for _, _, reward in ROWS.values()]
    assert result.data["reward/correct"].tolist() == [1.0, 0.0, 0.0]
    assert result.data["reward/brief"].tolist() == [0.5, 0.5, 0.0]
    assert result.metrics["env/errors"] == 1.0
    assert "data row 2" in str(result.metrics["env/first_error"]) and "difficulty" in str(
        result.metrics["env/first_error"]
    )


def test_the_trained_tokens_are_the_prompt_and_the_engine_ids(rollout, tiny_tokenizer):
    result, samples, engine = rollout
    data = result.data
    assert len(engine.requests) == 2  # one turn each; the errored sample never reached the endpoint
    for row, (reply, _, _) in enumerate(ROWS.values()):
        if reply is None:
            assert data["generation_lengths"][row] == 0
            continue
        text = tiny_tokenizer.apply_chat_template(samples[row].messages, add_generation_prompt=True, tokenize=False)
        prompt = tiny_tokenizer.encode(text, add_special_tokens=False)  # the whole render, independent of the server
        generated = tiny_tokenizer.encode(reply, add_special_tokens=False) + [tiny_tokenizer.eos_token_id]
        n = len(prompt) + len(generated)
        assert data["output_ids"][row, :n].tolist() == list(prompt) + generated
        assert data["token_mask"][row, :n].tolist() == [0.0] * len(prompt) + [1.0] * len(generated)
        assert int(data["input_lengths"][row]) == len(prompt) and int(data["unpadded_sequence_lengths"][row]) == n


def test_a_verifiers_environment_passes_rlcores_agent_environment_kit(verifiers_subprocesses):
    """The kit rolls the quiz out through rlcore's endpoint over its scripted engine: scored, through the endpoint
    only, and each episode's reward its own (again and alone)."""
    from rlcore.testing.agent_kit import AgentCase, check_agent_environment

    cases = [
        AgentCase([{"role": "user", "content": "What is 2+2?"}], {"ground_truth": "4"}, ["4"]),
        AgentCase([{"role": "user", "content": "What is 3+3?"}], {"ground_truth": "6"}, ["five"]),
    ]
    assert check_agent_environment("verifiers", {"environment": "rlv_quiz"}, cases) == []
