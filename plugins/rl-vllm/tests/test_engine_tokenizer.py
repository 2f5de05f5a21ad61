"""Which tokenizer the engines load: a checkpoint's weights/ directory holds none, so the run's own is taken."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from rl_vllm.config import VllmConfig
from rl_vllm.generation import engine_tokenizer


def test_a_model_directory_without_a_tokenizer_takes_the_runs_own(tmp_path: Path) -> None:
    weights, own, hub_copy = tmp_path / "weights", tmp_path / "tokenizer", tmp_path / "hub"
    for d in (weights, own, hub_copy):
        d.mkdir()
    (own / "tokenizer.json").write_text("{}")
    (hub_copy / "tokenizer_config.json").write_text("{}")
    driver = SimpleNamespace(name_or_path=str(own))
    assert engine_tokenizer(VllmConfig(), str(weights), driver) == str(own)
    assert engine_tokenizer(VllmConfig(), str(hub_copy), driver) is None  # the model's own
    assert engine_tokenizer(VllmConfig(tokenizer="/set"), str(weights), driver) == "/set"  # the setting wins
    assert engine_tokenizer(VllmConfig(), "tiny-llama", driver) is None  # a name rlcore builds
    assert engine_tokenizer(VllmConfig(), str(weights), SimpleNamespace(name_or_path="Qwen/Qwen2.5-0.5B")) is None
