"""The lines of a config read by ``rlcore run`` and ``rlcore config validate`` name what the user wrote
(issue 52, item 11)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlcore.cli.config_source import ConfigSource, load_cli_config
from rlcore.config import ConfigError
from rlcore.nemo_rl import rlcore_name

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sft_tiny.yaml"


def _problems(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_cli_config(EXAMPLE, list(overrides), ConfigSource.rlcore, None)
    return caught.value.problems


def test_a_nemo_rl_key_in_an_rlcore_config_is_told_rlcore_s_name_for_it():
    """``logger.log_dir`` was 'unknown key' alone; NeMo-RL users write it first."""
    assert _problems("logger.log_dir=runs/x") == [
        "logger.log_dir: unknown key; it is NeMo-RL's name for rlcore's logger.output_dir: set logger.output_dir "
        "(or read the file with --from nemo-rl)"
    ]
    assert rlcore_name("logger.tensorboard_enabled") == "logger.tensorboard"  # the mapping table says so
    assert rlcore_name("policy.train_global_batch_size") is None  # the same name in both: no renaming


def test_a_close_rlcore_key_keeps_its_did_you_mean():
    assert _problems("policy.train_micro_batchsize=2") == [
        "policy.train_micro_batchsize: unknown key; did you mean 'train_micro_batch_size'?"
    ]


def test_a_nemo_rl_default_key_is_named_as_written_and_its_fix_says_that_key(tmp_path):
    """``++data.default.prompt_file`` was answered as ``data.train.prompt_file``, told to set rlcore's
    ``data.prompt_file``."""
    import subprocess
    import sys

    fixtures = Path(__file__).resolve().parents[1] / "fixtures" / "nemo_rl"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlcore",
            "config",
            "validate",
            "--from",
            "nemo-rl",
            str(fixtures / "main" / "grpo_math_1B.yaml"),
        ]
        + [f"++data.default.prompt_file={tmp_path / 'none.txt'}", f"++data.train.data_path={fixtures / 'math.jsonl'}"]
        + ["policy.model_name=tiny-llama", "-o", "cluster.use_gpu=false"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in proc.stderr.splitlines() if not line.startswith(("notice:", "ignored:"))]
    assert proc.returncode == 1
    assert lines == [
        f"data.prompt_file (NeMo-RL: data.default.prompt_file): {tmp_path / 'none.txt'} does not exist; set "
        "data.default.prompt_file to a file holding the prompt template"
    ], lines
