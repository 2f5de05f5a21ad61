"""NeMo-RL main's PPO configs (ppo_math_1B.yaml: dtensor; ppo_math_1B_megatron.yaml: megatron-core) convert as
written and train on 2 CPU ranks: a policy and a critic (a value-head model of the critic's own ``value`` section)
beside a colocated vLLM engine.

Only these overrides: the model (the built-in tiny Qwen2, built locally), sizes (2 ranks, small batches and
lengths, a few steps, two PPO epochs), data (the local math rows of tests/fixtures/nemo_rl/math.jsonl for training
and validation, the prompt file beside them) and where the run writes. The tiny random model never writes a correct
answer (every reward is the same), so these runs show the machinery, not learning: ``rlcore run ppo_tiny`` learns
(docs/algorithms.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

FIXTURES = Path(__file__).parents[1] / "fixtures" / "nemo_rl"
MAIN = FIXTURES / "main"
STEPS = 3


def recipe_overrides(out: Path) -> list[str]:
    """NeMo-RL (Hydra) overrides: model, sizes, data, where the run writes; no CPU-only ones."""
    return [
        # model
        "policy.model_name=tiny-qwen2",
        # sizes
        "cluster.gpus_per_node=2",
        "ppo.num_prompts_per_step=8",
        "ppo.num_generations_per_prompt=2",
        f"ppo.max_num_steps={STEPS}",
        "ppo.ppo_epochs=2",
        "ppo.max_val_samples=4",
        "ppo.val_batch_size=4",
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
    ]


RLCORE_OVERRIDES = ["cluster.use_gpu=false", "logger.progress_bar=false"]


def load(name: str, out: Path) -> Any:
    from rlcore.nemo_rl import load_nemo_rl_config

    return load_nemo_rl_config(MAIN / name, recipe_overrides(out), RLCORE_OVERRIDES)


@pytest.mark.parametrize(
    ("name", "backend", "critic_lr"),
    [("ppo_math_1B.yaml", "dtensor", 1.0e-5), ("ppo_math_1B_megatron.yaml", "megatron", 2.0e-6)],
)
def test_the_configs_convert_as_written(tmp_path: Path, name: str, backend: str, critic_lr: float) -> None:
    """The ``ppo`` keys keep their names and NeMo-RL's values, ``value_loss_fn`` is ``value_loss``, and the critic
    is the policy's settings with its own (its learning rate, its sequence packing off)."""
    from rlcore.config import resolve

    loaded = load(name, tmp_path)
    resolved = resolve(loaded.config, run=True)
    cfg = resolved.config
    p = cfg.ppo
    assert (p.ppo_epochs, p.adv_estimator.gae_lambda, p.adv_estimator.gae_gamma) == (2, 0.95, 1.0)
    assert (p.reward_scaling.target_min, p.reward_shaping.overlong_buffer_length) == (-1.0, 2048)
    assert (cfg.value_loss.scale, cfg.value_loss.cliprange) == (0.4, 0.2)
    assert (cfg.loss.ratio_clip_max, cfg.loss.ratio_clip_c) == (0.28, 10)
    critic = resolved.value_model
    assert resolved.policy.spec.name == critic.spec.name == backend
    assert critic.config.learning_rate == critic_lr and critic.config.generation is None
    assert critic.config.sequence_packing.enabled is False
    assert any(path == "value.reward_model_cfg" for path, _ in loaded.conversion.ignored)


@pytest.mark.parametrize(
    "name",
    [
        # ~70 s each on 2 busy cores: a PPO run is in tests/algorithms/test_ppo_resume.py, the conversion above
        pytest.param("ppo_math_1B.yaml", marks=pytest.mark.slow),
        pytest.param("ppo_math_1B_megatron.yaml", marks=pytest.mark.slow),
    ],
)
def test_ppo_trains_a_policy_and_its_critic(ray_session: None, tmp_path: Path, name: str) -> None:
    """3 steps: every step trains the critic (its loss and explained variance logged), then the policy; the
    checkpoint holds the critic beside the policy, as a one-label token-classification model."""
    import torch
    from transformers import AutoModelForTokenClassification

    from rlcore.config import resolve
    from rlcore.run.train import train

    out = tmp_path / "run"
    summary = train(resolve(load(name, out).config, run=True))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("step", -1) >= 0 and "value_loss" in r]
    assert summary["steps"] == STEPS and [r["step"] for r in steps] == list(range(STEPS)), rows
    for row in steps:
        assert row["policy_trained"] == 1.0 and torch.isfinite(torch.tensor(row["loss"]))
        assert row["value_loss"] > 0 and "explained_variance" in row and row["time/value_train_s"] > 0
    critic_dir = out / "checkpoints" / f"step_{STEPS - 1:06d}" / "value" / "weights"
    critic = AutoModelForTokenClassification.from_pretrained(critic_dir)
    assert critic.config.num_labels == 1
