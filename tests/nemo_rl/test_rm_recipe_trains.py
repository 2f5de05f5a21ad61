"""NeMo-RL main's reward-model config (rm.yaml, Bradley-Terry on dtensor) converts as written and trains on 2 CPU
ranks, the policy built as a value model.

Only these overrides: the model (the built-in tiny Llama, built locally), sizes (2 ranks, small batches and lengths, a
few steps) and data (the shipped preference rows of rlcore's rm_tiny example as NeMo-RL's BinaryPreferenceDataset, in
place of HelpSteer3, which needs the hub) and where the run writes. ``rlcore run rm_tiny`` shows the learning
(docs/algorithms.md); this run shows the recipe's machinery.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

FIXTURES = Path(__file__).parents[1] / "fixtures" / "nemo_rl"
PAIRS = Path(__file__).parents[2] / "src" / "rlcore" / "examples" / "data" / "preference_dpo.jsonl"
STEPS = 3


def recipe_overrides(out: Path) -> list[str]:
    """NeMo-RL (Hydra) overrides: model, sizes, data, where the run writes."""
    return [
        "policy.model_name=tiny-llama",
        "cluster.gpus_per_node=2",
        f"rm.max_num_steps={STEPS}",
        f"rm.val_period={STEPS}",
        "rm.val_batches=1",
        "rm.val_global_batch_size=8",
        "policy.train_global_batch_size=8",
        "policy.train_micro_batch_size=2",
        "policy.max_total_sequence_length=256",
        *(
            f"++data.{split}.{key}={value}"
            for split in ("train", "validation")
            for key, value in (("dataset_name", "BinaryPreferenceDataset"), ("data_path", PAIRS))
        ),
        f"logger.log_dir={out}",
    ]


RLCORE_OVERRIDES = ["cluster.use_gpu=false", "logger.progress_bar=false", "logger.wandb_enabled=false"]


def load(out: Path) -> Any:
    from rlcore.nemo_rl import load_nemo_rl_config

    return load_nemo_rl_config(FIXTURES / "main" / "rm.yaml", recipe_overrides(out), RLCORE_OVERRIDES)


@pytest.mark.slow  # ~60 s; an rm run: tests/algorithms/test_rm.py; the conversion: test_nemo_rl_unsupported_algorithms
def test_rm_yaml_converts_as_written_and_trains_a_bradley_terry_reward_model(ray_session, tmp_path: Path) -> None:
    from rlcore.config import resolve
    from rlcore.run.train import train

    loaded = load(tmp_path)
    resolved = resolve(loaded.config, run=True)
    cfg = resolved.config
    assert cfg.algorithm == "rm" and resolved.policy_head == "value" and cfg.policy.training_backend == "dtensor"
    assert (cfg.rm.max_num_epochs, cfg.rm.val_micro_batch_size, cfg.rm.seed) == (1, 1, 42)  # NeMo-RL's, as written
    assert (cfg.rm.add_bos, cfg.rm.add_eos, cfg.rm.add_generation_prompt) == (True, True, False)
    assert cfg.checkpointing.metric_name == "validation/loss" and cfg.checkpointing.higher_is_better is False
    assert cfg.policy.learning_rate == 2.0e-6 and cfg.data.input_key == "prompt"
    train(resolved)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    last = rows[-1]
    assert 0.0 <= last["validation/accuracy"] <= 1.0 and last["validation/num_pairs"] == 8
    assert last["validation/loss"] > 0 and all(r["loss"] > 0 for r in rows)
