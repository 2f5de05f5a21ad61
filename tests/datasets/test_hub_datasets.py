"""Hub datasets through Hugging Face ``datasets``: a hub cache built in a temporary HF_HOME stands for the hub
(no network here), as ``hf download --repo-type dataset <id>`` leaves it; NeMo-RL's dataset names map to it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlcore.config.data import DataConfig, DatasetConfig
from rlcore.datasets import DataError, SampleBuilder
from rlcore.datasets.hub import read_hub_rows
from rlcore.datasets.sources import ROWS_CHECKED_AT_START, RowSamples
from tests.support.hub_cache import hub_cache, offline_home  # noqa: F401 (a fixture)

pytest.importorskip("datasets")
FIXTURE = Path(__file__).parents[1] / "fixtures" / "nemo_rl" / "v0.7.0" / "grpo_math_1B.yaml"
HUB_ID, SPLIT = "nvidia/OpenMathInstruct-2", "train_1M"  # what NeMo-RL's OpenMathInstruct-2 loads
ROWS = [{"problem": f"What is {a} + {a + 1}?", "expected_answer": str(2 * a + 1)} for a in range(40)]


def test_offline_a_downloaded_hub_dataset_loads_its_split(offline_home):
    hub_cache(
        offline_home,
        HUB_ID,
        {f"data/{SPLIT}-00000-of-00001.parquet": ROWS, "data/validation-00000-of-00001.parquet": ROWS[:3]},
    )
    rows = read_hub_rows(DatasetConfig(hub_id=HUB_ID, split=SPLIT))
    assert len(rows) == 40 and [rows[i] for i in (0, 39)] == [ROWS[0], ROWS[39]]
    assert list(read_hub_rows(DatasetConfig(hub_id=HUB_ID, split="validation"))) == ROWS[:3]


def test_offline_an_absent_hub_dataset_names_the_download(offline_home):
    with pytest.raises(
        DataError,
        match=r"^data.train.hub_id: org/absent is not in the hub cache .*hf download "
        r"--repo-type dataset org/absent",
    ):
        read_hub_rows(DatasetConfig(hub_id="org/absent"))


def test_hub_fields_need_a_hub_id():
    with pytest.raises(ValueError, match="subset: belongs to a hub dataset"):
        DatasetConfig(path="x.jsonl", subset="main")
    with pytest.raises(ValueError, match="exactly one of path"):
        DatasetConfig(path="x.jsonl", hub_id="a/b")


def test_rows_past_the_start_up_check_are_checked_as_drawn():
    """A set larger than ROWS_CHECKED_AT_START is checked on a spread of rows before the run, each other row
    when it is drawn: a bad row there still stops the run, in the same words."""
    n = 3 * ROWS_CHECKED_AT_START
    rows = [{"input": f"p{i}"} for i in range(n)]
    rows[n - 2] = {"other": 1}  # not among the spread (every 3rd row)
    samples = RowSamples(rows, SampleBuilder(DataConfig()), "d.parquet")
    spread = samples.spread(ROWS_CHECKED_AT_START)
    assert [s.idx for s in spread] == list(range(0, n, 3))
    assert samples[5].messages == [{"role": "user", "content": "p5"}]
    with pytest.raises(DataError, match=f"d.parquet: row {n - 1}: no field 'input'"):
        samples[n - 2]


def _rlcore(*args: str, env: dict[str, str]) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "rlcore", *args], capture_output=True, text=True, timeout=120, env={**os.environ, **env}
    )
    return out, time.monotonic() - start


CPU = [
    "policy.model_name=tiny-llama",
    "cluster.gpus_per_node=2",
    "policy.precision=float32",
    "policy.train_global_batch_size=8",
    "policy.train_micro_batch_size=2",
    "policy.max_total_sequence_length=48",
    "grpo.num_prompts_per_step=4",
    "grpo.num_generations_per_prompt=2",
    "grpo.max_num_steps=2",
    "checkpointing.enabled=false",
    "data.default.prompt_file=null",
    "env.math.num_workers=0",
]


def test_nemo_rl_config_with_no_data_override_validates_offline_against_the_cache(tmp_path):
    """NeMo-RL's grpo_math_1B.yaml names OpenMathInstruct-2: validated offline against a prepared hub cache, with
    no data override; with an empty cache it fails in one line naming the download, before Ray."""
    home = tmp_path / "hf"
    env = {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    args = ["--from", "nemo-rl", str(FIXTURE), *CPU, f"logger.log_dir={tmp_path}", "-o", "cluster.use_gpu=false"]
    out, _ = _rlcore("config", "validate", *args, env=env)
    assert out.returncode == 1
    lines = [line for line in out.stderr.splitlines() if "hub cache" in line]
    assert len(lines) == 1 and "hf download --repo-type dataset nvidia/OpenMathInstruct-2" in lines[0], out.stderr
    assert "NeMo-RL: data.train.dataset_name" in lines[0]  # the key the user wrote
    run, seconds = _rlcore("run", *args, env=env)
    assert run.returncode != 0 and lines[0] in run.stderr and "Ray" not in run.stderr, run.stderr[-2000:]
    assert seconds < 20, seconds  # the line itself comes in well under 3 s; this bounds a loaded CI machine

    hub_cache(home, "nvidia/OpenMathInstruct-2", {f"data/{SPLIT}-00000-of-00001.parquet": ROWS})
    out, _ = _rlcore("config", "validate", *args, env=env)
    assert out.returncode == 0, out.stderr


def test_nemo_rl_dataset_names_map_to_their_hub_datasets():
    """NeMo-RL's dataset names become data.*.hub_id; the flat layout's name brings its validation set; a name
    rlcore does not know is one line naming the data_path override."""
    from rlcore.config.errors import ConfigError
    from rlcore.nemo_rl import load_nemo_rl_config

    v04 = FIXTURE.parent.parent / "v0.4.0" / "grpo_math_1B.yaml"
    cfg = load_nemo_rl_config(v04, ["data.prompt_file=null", "data.dataset_name=DAPOMath17K"]).config
    assert (cfg.data.train.hub_id, cfg.data.validation.hub_id) == (
        "BytedTsinghua-SIA/DAPO-Math-17k",
        "BytedTsinghua-SIA/AIME-2024",
    )
    assert (cfg.data.messages_key, cfg.data.output_key) == ("prompt", "reward_model.ground_truth")
    cfg = load_nemo_rl_config(v04, ["data.prompt_file=null"]).config
    assert (cfg.data.train.hub_id, cfg.data.train.split, cfg.data.split_validation_size) == (HUB_ID, SPLIT, 0.05)
    with pytest.raises(ConfigError) as info:
        load_nemo_rl_config(FIXTURE, ["data.default.prompt_file=null", "data.train.dataset_name=NotADataset"])
    assert "data.train.dataset_name: is 'NotADataset', a dataset rlcore does not know by name" in str(info.value)
    assert "++data.train.data_path=/path/to/train.jsonl" in str(info.value)
