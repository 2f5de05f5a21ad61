"""NeMo-RL main's grpo_rm_1B.yaml (GRPO scored by a reward model) converts as written and trains 3 steps on CPU: the
policy on one rank beside a colocated vLLM engine, the reward model on a rank of its own
(``cluster.gpus_per_node`` 2, one of them ``env.reward_model.resources``').

Only these overrides: the model (the built-in tiny Qwen2), sizes, data (the local math rows), where the run writes,
and ``env.reward_model.model_name`` / ``checkpoint_path``: a tiny reward model built here (the tiny Qwen2's shape, a
random one-label token-classification model, as an ``rm`` run saves one), its head far from zero so that the scores
differ between completions.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

FIXTURES = Path(__file__).parents[1] / "fixtures" / "nemo_rl"
RECIPE = FIXTURES / "main" / "grpo_rm_1B.yaml"
STEPS = 3


def tiny_reward_model(root: Path) -> str:
    """A one-label token-classification model of the tiny Qwen2 preset, with its tokenizer, saved under ``root``."""
    import torch
    from transformers import AutoConfig, AutoModelForTokenClassification, AutoTokenizer

    from rlcore.models import resolve_model

    base = resolve_model("tiny-qwen2")
    config = AutoConfig.from_pretrained(base)
    config.num_labels = 1
    torch.manual_seed(0)
    model = AutoModelForTokenClassification.from_config(config)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 0.5)
    model.save_pretrained(root)
    AutoTokenizer.from_pretrained(base).save_pretrained(root)
    return str(root)


def recipe_overrides(out: Path, reward_model: str, tokenizer: str | None = None) -> list[str]:
    """NeMo-RL (Hydra) overrides: model, sizes, data, where the run writes, the reward model; no CPU-only ones."""
    return [
        # model
        "policy.model_name=tiny-qwen2",
        # sizes
        "grpo.num_prompts_per_step=4",
        "grpo.num_generations_per_prompt=4",
        f"grpo.max_num_steps={STEPS}",
        "policy.train_global_batch_size=16",
        "policy.train_micro_batch_size=4",
        "policy.logprob_batch_size=8",
        "policy.max_total_sequence_length=256",
        "data.max_input_seq_length=224",
        "policy.generation.max_new_tokens=16",
        # data
        *(
            f"++data.{split}.{key}={value}"
            for split in ("train", "validation")
            for key, value in (
                ("data_path", FIXTURES / "math.jsonl"),
                ("input_key", "problem"),
                ("output_key", "expected_answer"),
            )
        ),
        f"data.default.prompt_file={FIXTURES / 'cot.txt'}",
        # where the run writes
        f"logger.log_dir={out}",
        # the reward model
        f"env.reward_model.model_name={reward_model}",
        f"env.reward_model.checkpoint_path={reward_model}",
        f"env.reward_model.tokenizer.name={tokenizer or reward_model}",
    ]


RLCORE_OVERRIDES = ["cluster.use_gpu=false", "logger.progress_bar=false"]


def load(out: Path, reward_model: str, tokenizer: str | None = None) -> Any:
    from rlcore.nemo_rl import load_nemo_rl_config

    return load_nemo_rl_config(RECIPE, recipe_overrides(out, reward_model, tokenizer), RLCORE_OVERRIDES)


def rm_run_checkpoint(root: Path) -> tuple[str, str]:
    """The weights and the tokenizer of the last step of NeMo-RL's rm.yaml trained as
    tests/nemo_rl/test_rm_recipe_trains.py trains it (a Bradley-Terry reward model of the tiny Llama)."""
    from rlcore.config import resolve
    from rlcore.run.checkpoints import latest_step
    from rlcore.run.train import train
    from tests.nemo_rl.test_rm_recipe_trains import load as load_rm

    train(resolve(load_rm(root).config, run=True))
    found = latest_step(root / "checkpoints")
    assert found is not None
    return str(found[1] / "weights"), str(found[1] / "tokenizer")


@pytest.mark.slow  # ~45 s with a built reward model, ~100 s after an rm.yaml run; the environment is tested fast
@pytest.mark.parametrize("source", ["built", "rm.yaml run"])
def test_grpo_rm_trains_three_steps_scored_by_the_reward_model(ray_session: None, tmp_path: Path, source: str) -> None:
    """3 GRPO steps; each step's rewards are the reward model's scores (reward/reward_model_mean is reward_mean: the
    recipe shapes and scales nothing), none failed, and they differ between completions (the advantages are not
    all zero, so the policy trains). The reward model: one built here, or the checkpoint an ``rm`` run of NeMo-RL's
    rm.yaml saved (another model and tokenizer than the policy's)."""
    from rlcore.config import resolve
    from rlcore.run.train import train

    if source == "built":
        reward_model, tokenizer = tiny_reward_model(tmp_path / "rm"), None
    else:
        reward_model, tokenizer = rm_run_checkpoint(tmp_path / "rm")
    resolved = resolve(load(tmp_path / "run", reward_model, tokenizer).config, run=True)
    section = resolved.environment.section
    assert resolved.environment.spec.name == "reward_model" and resolved.config.cluster.workers_per_node == 1
    assert (section.model_name, section.checkpoint_path) == (reward_model, reward_model)
    assert section.resources.world_size == 1 and section.precision == "bfloat16"
    summary = train(resolved)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("step", -1) >= 0 and "loss" in r]
    assert summary["steps"] == STEPS and [r["step"] for r in steps] == list(range(STEPS)), rows
    for row in steps:
        assert row["env/errors"] == 0 and math.isfinite(row["loss"]), row
        assert abs(row["reward/reward_model_mean"] - row["reward_mean"]) < 1e-6, row
    assert len({round(r["reward_mean"], 6) for r in steps}) > 1, [r["reward_mean"] for r in steps]
