"""A verifiers tool taskset (tests/envs/rlv_digits.py: the calculator MCP tool, a digits reward) with the tiny Llama
and rl-vllm's async engine, every episode through rlcore's endpoint (slow): its episodes rolled out by
``run_agent_rollout`` over the real engine, and 5 GRPO steps."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from rlcore.datasets import Sample

pytestmark = pytest.mark.slow

STEPS = 5


def config(tmp_path: Path, tiny_tokenizer: Any) -> dict[str, Any]:
    rows = [{"problem": f"Write digits ({i}); the add tool adds two integers.", "answer": "0"} for i in range(8)]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {
        "cluster": {"num_nodes": 1, "workers_per_node": 1},
        "policy": {
            "backend": "dtensor",
            "model_name": "tiny-llama",
            "precision": "float32",
            "train_global_batch_size": 8,
            "train_micro_batch_size": 4,
            "logprob_batch_size": 8,
            "max_total_sequence_length": 256,
            "learning_rate": 3.0e-3,
            "generation": {
                "backend": "vllm",
                "max_new_tokens": 16,
                "temperature": 1.0,
                "vllm_cfg": {"kv_cache_space_gb": 0.125, "max_model_len": 256, "async_engine": True},
            },
        },
        "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 4, "max_num_steps": STEPS, "seed": 0},
        "loss": {"reference_policy_kl_penalty": 0.0},
        "data": {"train": {"path": str(data)}, "input_key": "problem", "output_key": "answer"},
        "env": {
            "name": "verifiers",
            "verifiers_cfg": {
                "environment": "rlv_digits",
                "args": {"agent": {"max_turns": 2}},
                "ground_truth_field": None,  # the digits reward needs no answer (the task data has no field for it)
            },
        },
        "logger": {"output_dir": str(tmp_path / "run"), "progress_bar": False},
        "checkpointing": {"enabled": False},
    }


def test_the_config_resolves(tmp_path, tiny_tokenizer):
    from rlcore.config import load_config_dict, resolve

    resolved = resolve(load_config_dict(config(tmp_path, tiny_tokenizer)), run=True)
    assert resolved.generation.section.async_engine is True
    assert resolved.config.env.name == "verifiers"


def test_a_verifiers_tool_taskset_trains_five_grpo_steps(tmp_path, tiny_tokenizer, verifiers_subprocesses):
    from rlcore.config import load_config_dict
    from rlcore.run.train import train

    train(load_config_dict(config(tmp_path, tiny_tokenizer)))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/loss" in r or "loss" in r]
    assert len(steps) == STEPS
    for row in steps:
        assert row.get("env/errors", 0.0) == 0.0, row.get("env/first_error")
        assert all(math.isfinite(v) for v in row.values() if isinstance(v, float))
    rewards = [r for row in steps for k, r in row.items() if k.endswith("reward_mean") or k == "reward/mean"]
    assert rewards and any(r > 0 for r in rewards)  # digits in some replies: a signal GRPO can follow


def test_episodes_through_a_real_async_engine_score_what_the_engine_wrote(
    tmp_path, ray_session, tiny_model_dir, tiny_tokenizer, verifiers_subprocesses
):
    """Each reward is the rubric on the reply the engine's own tokens spell (decoded from the rollout's trained
    tokens): the digits fraction of the stripped text; the tiny model calls no tool, so used_tool is 0."""
    from rl_vllm.generation import VllmGeneration
    from rlcore.config import load_config_dict
    from rlcore.plugins import get_registry
    from rlcore.run.agent_rollouts import run_agent_rollout
    from rlcore.run.step import Timer
    from rlcore.testing.pytest_plugin import ClusterPool

    raw = config(tmp_path, tiny_tokenizer)
    raw["policy"]["model_name"] = tiny_model_dir
    raw["policy"]["generation"]["pad_token_id"] = tiny_tokenizer.pad_token_id
    raw["policy"]["generation"]["vllm_cfg"]["engine_kwargs"] = {"block_size": 32}
    cfg = load_config_dict({k: raw[k] for k in ("policy", "grpo")})
    spec = get_registry().resolve_environment("verifiers")  # as a run finds it
    section = spec.load_config_class()(**raw["env"]["verifiers_cfg"])
    environment = spec.load_environment_class()(section)
    samples = [Sample(i, [{"role": "user", "content": f"Write digits ({i})."}], {}) for i in range(2)]
    clusters = ClusterPool()
    generation = None
    try:
        generation = VllmGeneration(clusters(1), cfg.policy.generation, name_prefix="verifiers-vllm")
        rollout = run_agent_rollout(cfg, generation, environment, tiny_tokenizer, samples, 2, Timer())
    finally:
        if generation is not None:
            generation.shutdown()
        clusters.shutdown()
    data = rollout.data
    assert rollout.metrics["env/errors"] == 0.0, rollout.metrics.get("env/first_error")
    assert rollout.metrics["rollout/turns_mean"] == 1.0  # no tool call: one turn each
    for row in range(4):
        trained = data["output_ids"][row][data["token_mask"][row].bool()].tolist()
        reply = tiny_tokenizer.decode(trained, skip_special_tokens=True).strip()
        expected = sum(c.isdigit() for c in reply) / len(reply) if reply else 0.0
        assert float(rollout.rewards[row]) == pytest.approx(expected, abs=1e-6), reply
        assert float(data["reward/used_tool"][row]) == 0.0
