"""A save period that is not a multiple of the validation period is NeMo-RL's warning, not a refusal (issue 53):
the checkpoints of steps without validation record no metric and stay out of the top-k.

The reference for the top-k is NeMo-RL's ``CheckpointManager.remove_old_checkpoints`` (nemo_rl/utils/checkpoint.py
at the fixtures' commit), written out below: the periodic checkpoints sorted by (metric, step), a missing metric
as the worst value, the best ``keep_top_k`` kept and the newest protected.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from rlcore.config import ConfigError, load_config_dict
from rlcore.run.checkpoints import kept

ROWS = Path(__file__).parents[1] / "fixtures" / "nemo_rl" / "math.jsonl"


def _config(val_period: int, save_period: int) -> dict:
    return {
        "grpo": {"val_period": val_period},
        "data": {"train": {"path": str(ROWS)}, "validation": {"path": str(ROWS)}},
        "env": {"name": "math"},
        "checkpointing": {"metric_name": "validation/accuracy", "save_every_n_steps": save_period},
    }


def test_a_save_period_off_the_validation_period_loads_with_a_warning_naming_both_paths():
    with pytest.warns(UserWarning) as caught:
        cfg = load_config_dict(_config(val_period=2, save_period=3))
    assert cfg.checkpointing.save_every_n_steps == 3
    [line] = [str(w.message) for w in caught if "checkpointing.metric_name" in str(w.message)]
    assert "grpo.val_period=2" in line and "save_every_n_steps=3" in line and "out of the top-k" in line
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a multiple warns nothing
        load_config_dict(_config(val_period=2, save_period=4))
    with pytest.raises(ConfigError, match="is never measured"):  # no validation at all stays an error
        load_config_dict(_config(val_period=0, save_period=3))


def _nemo_rl_top_k(history: list[tuple[int, dict[str, float]]], k: int, metric: str, higher: bool) -> set[int]:
    """NeMo-RL's retention, as its CheckpointManager writes it (every checkpoint here is a periodic one)."""
    worst = -float("inf") if higher else float("inf")
    if higher:
        ranked = sorted(history, key=lambda x: (x[1].get(metric, worst), x[0]), reverse=True)
    else:
        ranked = sorted(history, key=lambda x: (x[1].get(metric, worst), -x[0]))
    return {s for s, _ in ranked[:k]} | {max(s for s, _ in history)}


@pytest.mark.parametrize("higher", [True, False])
def test_checkpoints_of_unvalidated_steps_stay_out_of_the_top_k_as_in_nemo_rl(higher):
    # saved every 3 steps, validated every 2: steps 6, 12, 18 have the metric, 3, 9, 15, 21 do not
    accuracy = {6: 0.2, 12: 0.9, 18: 0.5}
    history = [(s, {"validation/accuracy": accuracy[s]} if s in accuracy else {}) for s in range(3, 22, 3)]
    for k in (1, 2, 3, 5):
        states = [(Path(f"step_{s}"), {"step": s, "metrics": m}) for s, m in history]
        ours = {int(d.name.split("_")[1]) for d in kept(states, k, ("validation/accuracy", higher))}
        assert ours == _nemo_rl_top_k(history, k, "validation/accuracy", higher), (k, higher)
