"""The grpo_vlm_tiny example end to end, as a user runs it: dtensor trains the tiny Qwen2.5-VL on drawn pictures
and vLLM generates from the same pixels (docs/vision.md); two steps, then the checkpoint is a vision-language
model again. The learning curve is measured by running the example (its header and the issue's note), not here."""

from __future__ import annotations

import json
import math
import subprocess
import sys


def test_two_steps_train_and_save_a_vision_language_checkpoint(tmp_path):
    out = tmp_path / "run"
    overrides = ["grpo.max_num_steps=2", f"logger.output_dir={out}", "logger.progress_bar=false"]
    run = subprocess.run(
        [sys.executable, "-m", "rlcore", "run", "grpo_vlm_tiny", *[a for o in overrides for a in ("-o", o)]],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [0, 1]
    for step in steps:
        assert math.isfinite(step["loss"]) and 0.0 <= step["reward_mean"] <= 1.0
        assert {"reward/format_mean", "reward/count_mean", "image_placeholder_cuts"} <= set(step)
    summary = json.loads((out / "summary.json").read_text())
    weights = summary["final_weights"]
    config = json.loads(open(f"{weights}/config.json").read())
    assert "vision_config" in config  # the checkpoint loads as the image-text model it was
