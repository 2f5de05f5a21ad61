"""A model whose head size vLLM's CPU attention does not take is refused before Ray (issue 52, item 10): a
user's own tiny model with head_dim 16 passed validate, then died inside vLLM 62 s in ("Unsupported CPU
attention configuration: head_dim=16"). The limit is the engine plugin's to know (``BackendSpec.checks``)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rl_vllm.checks import CPU_HEAD_SIZES, check_cpu_head_size

REPO = Path(__file__).resolve().parents[3]


def _model(directory: Path, **config: object) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_the_sizes_are_the_installed_vllm_s():
    backend = pytest.importorskip("vllm.v1.attention.backends.cpu_attn")
    assert tuple(backend.CPUAttentionBackend.get_supported_head_sizes()) == CPU_HEAD_SIZES


def test_the_head_size_is_read_as_the_model_defines_it(tmp_path):
    small = check_cpu_head_size(str(_model(tmp_path / "a", hidden_size=64, num_attention_heads=4)))
    assert small is not None and small.status == "fail" and small.details["head_dim"] == 16
    assert small.message.startswith(f"the model's head size is 16 ({tmp_path / 'a'}'s config.json: head_dim")
    explicit = check_cpu_head_size(str(_model(tmp_path / "b", hidden_size=64, num_attention_heads=4, head_dim=32)))
    assert explicit is not None and explicit.status == "ok"
    nested = check_cpu_head_size(str(_model(tmp_path / "c", text_config={"hidden_size": 96, "num_attention_heads": 4})))
    assert nested is not None and nested.details["head_dim"] == 24 and nested.status == "fail"
    assert check_cpu_head_size("Qwen/Qwen2.5-0.5B") is None  # a hub id whose config is not in the cache
    assert check_cpu_head_size(str(tmp_path / "missing")) is None


def test_config_validate_refuses_it_in_one_line_before_ray(tmp_path, tiny_model_dir):
    model = tmp_path / "heads16"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["head_dim"] = 16  # what the user's model says; the weights are not read before Ray
    (model / "config.json").write_text(json.dumps(config))
    proc = subprocess.run(
        [sys.executable, "-m", "rlcore", "config", "validate", str(REPO / "examples" / "grpo_tiny.yaml")]
        + ["-o", f"policy.model_name={model}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in proc.stderr.splitlines() if not line.startswith(("notice:", "ignored:"))]
    assert proc.returncode == 1, proc.stderr
    assert len(lines) == 1 and "the model's head size is 16" in lines[0], lines
    assert lines[0].startswith("policy.generation.backend"), lines
