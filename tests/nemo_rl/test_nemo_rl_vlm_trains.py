"""Issue 57's "Done when": NeMo-RL main's vlm_grpo_3B.yaml and sft_vlm_3B.yaml, run as a user runs them
(``rlcore run --from nemo-rl``), each train 2 steps on 2 CPU ranks with only model, size and data overrides,
offline, from a hub cache built here: CLEVR-CoGenT's two repositories (``MMInstruction/Clevr_CoGenT_TrainA_70K_Complex``
and ``..._ValA``, each read as its 'train' split) as parquet written by ``datasets``, the ``image`` column a
``datasets.Image`` feature holding real PNG bytes.

The images are 28 x 28 to 56 x 56 pixels: 4 image tokens each for the tiny Qwen2.5-VL (14-pixel patches merged
2 x 2, at least 56 x 56 pixels after its processor's resize). Its tokenizer spells text a character a token, so a
prompt is about 90 tokens. Each run starts Ray and 2 dtensor ranks; GRPO's also 2 vLLM engines, over a minute on
the 2-core CI machine: its test is ``slow``.
"""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

MAIN = Path(__file__).parents[1] / "fixtures" / "nemo_rl" / "main"
GRPO = MAIN / "vlm_grpo_3B.yaml"
SFT = MAIN / "sft_vlm_3B.yaml"
CLEVR = "MMInstruction/Clevr_CoGenT_"
SHARD = "data/train-00000-of-00001.parquet"  # the hub's file of each repository's one split

#: (image size, colour, problem, the answer in solution's <answer> tags): CLEVR-CoGenT's columns.
TRAIN = [
    ((28, 28), "red", "How many cubes?", "3"),
    ((56, 56), "blue", "Is there a sphere?", "yes"),
    ((56, 28), "green", "How many cylinders?", "2"),
    ((28, 56), "yellow", "What color is the cube?", "red"),
]
VAL = [
    ((28, 28), "purple", "How many spheres?", "1"),
    ((56, 56), "gray", "Is there a cylinder?", "no"),
]


def _png(size: tuple[int, int], color: str) -> bytes:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", size, color)
    ImageDraw.Draw(image).rectangle((2, 2, size[0] // 2, size[1] // 2), fill="white")  # not one flat colour
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _parquet(path: Path, rows: list[tuple]) -> bytes:
    """The rows as the hub's files hold them: written by ``datasets``, ``image`` a ``datasets.Image`` feature."""
    import datasets

    features = datasets.Features(
        {"image": datasets.Image(), "problem": datasets.Value("string"), "solution": datasets.Value("string")}
    )
    records = [
        {"image": {"bytes": _png(size, color), "path": None}, "problem": q, "solution": f"<answer> {a} </answer>"}
        for size, color, q, a in rows
    ]
    datasets.Dataset.from_list(records, features=features).to_parquet(str(path))
    assert isinstance(datasets.Dataset.from_parquet(str(path)).features["image"], datasets.Image)  # as on the hub
    return path.read_bytes()


@pytest.fixture
def clevr_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An offline HF_HOME holding both CLEVR-CoGenT repositories (this process's environment points at it too)."""
    from tests.support.hub_cache import hub_cache

    home = tmp_path / "hf"
    for repo, rows, name in ((f"{CLEVR}TrainA_70K_Complex", TRAIN, "train"), (f"{CLEVR}ValA", VAL, "val")):
        hub_cache(home, repo, {SHARD: _parquet(tmp_path / f"{name}.parquet", rows)})
    for name, value in (("HF_HOME", str(home)), ("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1")):
        monkeypatch.setenv(name, value)
    for name in ("HF_HUB_CACHE", "HF_DATASETS_CACHE"):
        monkeypatch.delenv(name, raising=False)
    return home


def _the_runs_samples_have_their_images(config: Path, nemo_overrides: list[str]) -> None:
    """The samples the run draws, read here with the same config and hub cache: each with its row's image."""
    from rlcore.datasets import load_sources
    from rlcore.nemo_rl import load_nemo_rl_config

    loaded = load_nemo_rl_config(config, nemo_overrides, ["cluster.use_gpu=false"])
    run_data = load_sources(loaded.config, images=True)
    train = sorted(run_data.train.samples, key=lambda s: s.idx)
    assert [[image.size for image in s.images] for s in train] == [[size] for size, *_ in TRAIN]
    assert [[image.size for image in s.images] for s in run_data.validation] == [[size] for size, *_ in VAL]
    assert train[0].images[0].getpixel((20, 20)) == (255, 0, 0)  # the PNG's pixels, decoded


def _run(config: Path, nemo_overrides: list[str]) -> subprocess.CompletedProcess:
    start = time.monotonic()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlcore",
            "run",
            "--from",
            "nemo-rl",
            str(config),
            *nemo_overrides,
            "-o",
            "cluster.use_gpu=false",
            "-o",
            "logger.progress_bar=false",
        ],
        capture_output=True,
        text=True,
        timeout=400,
        env=dict(os.environ),  # the offline hub cache (clevr_home)
    )
    print(f"{config.name}: rlcore run took {time.monotonic() - start:.0f} s")
    assert out.returncode == 0, out.stderr[-4000:]
    return out


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _finite(row: dict, *keys: str) -> None:
    for key in keys:
        value = row[key]
        assert isinstance(value, (int, float)) and math.isfinite(value), (row["step"], key, value)


@pytest.mark.slow  # about 85-110 s here: Ray, 2 dtensor ranks and 2 vLLM engines on 2 cores
def test_vlm_grpo_3b_trains_two_steps_on_two_cpu_ranks_from_the_clevr_hub_cache(clevr_home: Path, tmp_path: Path):
    prompt = tmp_path / "clevr_cogent_cot.txt"  # NeMo-RL's examples/prompts/ file is relative to its repository
    prompt.write_text("Answer in <answer></answer> tags.\n{}")
    run_dir = tmp_path / "run"
    nemo_overrides = [
        "policy.model_name=tiny-qwen2.5-vl",  # model
        "cluster.gpus_per_node=2",  # size (the config's own 2: 2 ranks, 2 colocated engines)
        "policy.precision=float32",
        "grpo.num_prompts_per_step=2",
        "grpo.num_generations_per_prompt=2",
        "policy.train_global_batch_size=4",
        "policy.train_micro_batch_size=1",
        "policy.logprob_batch_size=2",
        "policy.max_total_sequence_length=128",  # ~95 prompt tokens (4 of them the image's) and the completion
        "policy.generation.max_new_tokens=8",
        "policy.generation.vllm_cfg.enforce_eager=true",
        "grpo.max_num_steps=2",
        "grpo.val_period=1",
        "grpo.val_batch_size=2",
        "grpo.max_val_samples=2",
        "checkpointing.enabled=false",
        f"logger.log_dir={run_dir}",
        "env.clevr-cogent.num_workers=0",
        f"data.default.prompt_file={prompt}",  # data
    ]
    _the_runs_samples_have_their_images(GRPO, nemo_overrides)
    out = _run(GRPO, nemo_overrides)
    assert "scored by vlm, 2 steps" in out.stderr  # CLEVR's env, NeMo-RL's format + exact_alnum rewards
    assert json.loads(out.stdout.strip().splitlines()[-1])["steps"] == 2
    rows = [r for r in _metrics(run_dir) if "token_mult_prob_error" in r]
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        _finite(row, "loss", "reward_mean", "reward/format_mean", "reward/exact_alnum_mean", "grad_norm")
        assert row["cut_prompts"] == 0 and "image_placeholder_cuts" in row  # whole image prompts, an image run
        # vLLM (given the images) and the trainer (given their pixel_values) score the same tokens alike
        assert abs(row["token_mult_prob_error"] - 1.0) < 1e-3, row["token_mult_prob_error"]
        assert row["validation/num_samples"] == 2  # ValA's two rows, validated after each step
        _finite(row, "validation/accuracy")


# 25-65 s here (Ray and 2 dtensor ranks on 2 cores)
def test_sft_vlm_3b_trains_two_steps_on_two_cpu_ranks_from_the_clevr_hub_cache(clevr_home: Path, tmp_path: Path):
    run_dir = tmp_path / "run"
    nemo_overrides = [
        "policy.model_name=tiny-qwen2.5-vl",  # model
        "cluster.gpus_per_node=2",  # size (the config's own 2: 2 ranks)
        "policy.precision=float32",
        "policy.train_global_batch_size=2",
        "policy.train_micro_batch_size=1",
        "policy.max_total_sequence_length=96",  # ~60 tokens a sample (4 of them the image's)
        "sft.max_num_steps=2",
        "sft.val_global_batch_size=2",
        "sft.val_micro_batch_size=1",
        "sft.val_batches=1",
        f"logger.log_dir={run_dir}",  # checkpointing stays on (saved after the last step, under the log dir)
    ]
    _the_runs_samples_have_their_images(SFT, nemo_overrides)
    out = _run(SFT, nemo_overrides)
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2
    logged = _metrics(run_dir)
    assert [r["step"] for r in logged] == [-1, 0, 1]  # sft.val_at_start, then the 2 steps
    assert logged[0]["validation/num_samples"] == 2
    _finite(logged[0], "validation/loss")
    for row in logged[1:]:
        _finite(row, "loss", "grad_norm")
        assert row["loss"] > 0 and row["num_valid_tokens"] > 0  # the answers carry the loss
        assert row["cut_samples"] == 0  # no sample cut: each trained with its image (docs/vision.md)
    weights = Path(summary["final_weights"])
    assert (weights / "model.safetensors").stat().st_size > 0
    config = json.loads((weights / "config.json").read_text())
    assert config["model_type"] == "qwen2_5_vl" and "vision_config" in config  # the VLM, vision tower included
