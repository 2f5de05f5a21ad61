"""The grpo_vlm_tiny example end to end, as a user runs it: ``rlcore run`` runs its warm start (an SFT of the
tiny Qwen2.5-VL on drawn pictures) first, then GRPO from that checkpoint, dtensor training and vLLM generating
from the same pixels (docs/vision.md). Two steps of each here, then the checkpoint is a vision-language model
again. The learning curve is measured by running the example (its header and the issue's note), and in the slow
test below."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlcore.examples import example_path


def _write(tmp_path: Path, sft_steps: int, grpo_steps: int) -> tuple[Path, Path, Path]:
    """The two example configs with these step counts, writing under ``tmp_path``; GRPO's warm start is the SFT
    copy. Returns (the GRPO config, the SFT's output directory, GRPO's)."""
    sft_dir, grpo_dir = tmp_path / "sft", tmp_path / "grpo"
    sft = yaml.safe_load(example_path("grpo_vlm_tiny_sft").read_text())
    sft["sft"]["max_num_steps"] = sft_steps
    sft["checkpointing"]["save_every_n_steps"] = sft_steps
    sft["logger"] = {**sft["logger"], "output_dir": str(sft_dir), "progress_bar": False}
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(sft))
    grpo = yaml.safe_load(example_path("grpo_vlm_tiny").read_text())
    grpo["policy"]["warm_start"] = str(tmp_path / "sft.yaml")
    grpo["grpo"]["max_num_steps"] = grpo_steps
    grpo["logger"] = {**grpo["logger"], "output_dir": str(grpo_dir), "progress_bar": False}
    (tmp_path / "grpo.yaml").write_text(yaml.safe_dump(grpo))
    return tmp_path / "grpo.yaml", sft_dir, grpo_dir


def _run(config: Path, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlcore", "run", str(config)], capture_output=True, text=True, timeout=timeout, cwd=cwd
    )


def test_the_warm_start_then_two_grpo_steps_train_and_save_a_vision_language_checkpoint(tmp_path):
    config, sft_dir, grpo_dir = _write(tmp_path, sft_steps=2, grpo_steps=2)
    run = _run(config, tmp_path, timeout=500)
    assert run.returncode == 0, run.stderr[-3000:]
    # GRPO's engine started from the SFT's weights directory: its image processor is there too
    sft_weights = json.loads((sft_dir / "summary.json").read_text())["final_weights"]
    steps = [json.loads(line) for line in (grpo_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [0, 1]
    for step in steps:
        assert math.isfinite(step["loss"]) and 0.0 <= step["reward_mean"] <= 1.0
        assert {"reward/format_mean", "reward/count_mean", "image_placeholder_cuts"} <= set(step)
    weights = json.loads((grpo_dir / "summary.json").read_text())["final_weights"]
    from transformers import AutoImageProcessor

    for directory in (sft_weights, weights):
        config_json = json.loads((Path(directory) / "config.json").read_text())
        assert "vision_config" in config_json  # the checkpoint loads as the image-text model it was
        # with its image processor beside the weights, where an engine started from them reads it
        assert AutoImageProcessor.from_pretrained(directory).merge_size == 2


def test_both_configs_resolve_and_the_grpo_one_waits_for_its_warm_start(tmp_path, monkeypatch):
    from rlcore.config import load_config, resolve
    from rlcore.preflight import preflight, problem_lines

    monkeypatch.chdir(tmp_path)  # no runs/ here: the warm start has not run
    sft = resolve(load_config(example_path("grpo_vlm_tiny_sft")), run=True)
    assert sft.config.algorithm == "sft" and problem_lines(preflight(sft)) == []
    as_shipped = resolve(load_config(example_path("grpo_vlm_tiny")), run=True)
    assert sft.config.sft.seed != as_shipped.config.grpo.seed  # the SFT's pictures are not GRPO's
    assert as_shipped.config.policy.warm_start == "grpo_vlm_tiny_sft"
    assert any("'grpo_vlm_tiny_sft' has not finished" in notice for notice in as_shipped.notices)


@pytest.mark.slow
def test_grpo_from_the_warm_start_counts_better_than_chance(tmp_path):
    """About 5 minutes on 2 CPU cores: the whole warm start (400 SFT steps), then 4 GRPO steps from it. The
    count is right on more than 0.45 of 128 answers to fresh pictures (chance: 1/3; the warm start's own sampled
    answers: 0.63-0.67, measured)."""
    config, _, grpo_dir = _write(tmp_path, sft_steps=400, grpo_steps=4)
    run = _run(config, tmp_path, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    from rlcore.environments.vlm_tasks import COUNT_WEIGHT

    steps = [json.loads(line) for line in (grpo_dir / "metrics.jsonl").read_text().splitlines()]
    right = sum(s["reward/count_mean"] for s in steps) / len(steps) / COUNT_WEIGHT
    assert right > 0.45, right
