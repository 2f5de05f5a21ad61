"""The progress bar shows what a step measured, and nothing it did not: a step that trained nothing has no loss,
and the bar says ``loss=-`` rather than a perfect ``loss=0.0000``."""

from __future__ import annotations

import io
import json

from rlcore.run.metrics import MetricsLogger


def bar_after(tmp_path, *rows: dict) -> str:
    out = io.StringIO()
    logger = MetricsLogger(tmp_path, tensorboard=False, progress_file=out, total_steps=len(rows))
    for step, row in enumerate(rows, 1):
        logger.log(step, row)
    shown = str(logger._bar)  # the bar's line as the terminal last got it
    logger.close()
    return shown


def test_a_step_without_a_loss_shows_none(tmp_path):
    shown = bar_after(tmp_path, {"reward_mean": 0.25, "time/step_s": 1.5})
    assert "loss=-" in shown and "loss=0" not in shown, shown
    assert "reward=0.250" in shown and "step_s=1.50" in shown, shown
    (row,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert "loss" not in row  # and metrics.jsonl invents none either


def test_a_step_with_a_loss_shows_it_and_a_zero_loss_stays_zero(tmp_path):
    assert "loss=0.1235" in bar_after(tmp_path, {"loss": 0.12345, "time/step_s": 0.5})
    assert "loss=0.0000" in bar_after(tmp_path / "zero", {"loss": 0.0, "time/step_s": 0.5})


def test_a_step_without_a_time_shows_none(tmp_path):
    shown = bar_after(tmp_path, {"loss": 1.0})
    assert "step_s=-" in shown and "loss=1.0000" in shown, shown
