"""policy.warm_start: the model and tokenizer come from another config's finished run (its summary.json names the
last checkpoint); before it has finished a run is refused and validate says so; a cycle of warm starts is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlcore.config import ConfigError, load_config, load_config_dict, resolve
from rlcore.config.warm_start import RUN_SUMMARY, with_warm_start


def write_configs(tmp_path: Path) -> tuple[Path, Path]:
    """A one-step SFT config (output in tmp_path/sft) and an SFT config that warm-starts from it."""
    first = tmp_path / "first.yaml"
    first.write_text(yaml.safe_dump({"sft": {"max_num_steps": 1}, "logger": {"output_dir": str(tmp_path / "sft")}}))
    second = tmp_path / "second.yaml"
    second.write_text(
        yaml.safe_dump(
            {
                "policy": {"warm_start": str(first), "tokenizer": {"chat_template": "default"}},
                "sft": {"max_num_steps": 1},
                "logger": {"output_dir": str(tmp_path / "second")},
            }
        )
    )
    return first, second


def test_a_finished_warm_start_gives_the_model_and_tokenizer_of_its_last_checkpoint(tmp_path):
    _, second = write_configs(tmp_path)
    checkpoint = tmp_path / "sft" / "checkpoints" / "step_000000"
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / RUN_SUMMARY).write_text(json.dumps({"final_weights": str(checkpoint / "weights")}))
    cfg = load_config(second)
    policy = with_warm_start(cfg, []).policy
    assert (policy.model_name, policy.tokenizer.name) == (str(checkpoint / "weights"), str(checkpoint / "tokenizer"))
    assert policy.warm_start is None and policy.tokenizer.chat_template == "default"  # applied; the rest kept


def test_before_it_finished_training_is_refused_and_resolving_notes_it(tmp_path):
    from rlcore.run.train import train

    first, second = write_configs(tmp_path)
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / RUN_SUMMARY).write_text("{")  # half-written: not finished
    expected = f"policy.warm_start: {str(first)!r} has not finished (no {tmp_path / 'sft' / RUN_SUMMARY})"
    resolved = resolve(load_config(second), run=True)
    assert resolved.config.policy.warm_start == str(first)
    assert f"notice: {expected}; rlcore run runs it first and starts from its last checkpoint" in resolved.notices
    with pytest.raises(ConfigError) as refused:
        train(resolved)
    assert refused.value.problems == [expected + ": rlcore run runs it first, or run it yourself"]
    assert not (tmp_path / "second").exists()  # refused before anything was written


def test_a_model_beside_it_or_an_unknown_warm_start_is_refused():
    with pytest.raises(ConfigError, match=r"policy.warm_start: 'sft_tiny' gives the starting model"):
        load_config_dict({"policy": {"warm_start": "sft_tiny", "model_name": "tiny-qwen2"}})
    with pytest.raises(ConfigError) as unknown:
        resolve(load_config_dict({"policy": {"warm_start": "no_such_example"}}))
    assert unknown.value.problems[0].startswith(
        "policy.warm_start: 'no_such_example' is neither a config file nor an example (no example named"
    )


def test_rlcore_run_refuses_a_warm_start_that_starts_from_itself(tmp_path):
    looped = tmp_path / "looped.yaml"
    looped.write_text(yaml.safe_dump({"policy": {"warm_start": str(looped)}, "sft": {"max_num_steps": 1}}))
    done = subprocess.run(
        [sys.executable, "-m", "rlcore", "run", str(looped)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "RLCORE_WARM_START_CHAIN": str(looped.resolve())},  # as inside its own warm start
        timeout=120,
    )
    assert done.returncode == 1
    assert f"error: policy.warm_start: {str(looped)!r} starts from itself (through {looped.resolve()})" in done.stderr
