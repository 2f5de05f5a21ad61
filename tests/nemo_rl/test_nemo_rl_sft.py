"""Reading NeMo-RL's SFT configs: its own examples/configs/sft.yaml (main and the four releases), their local
data (ResponseDataset and OpenAI-format rows), what stays an error, and one real ``rlcore run --from nemo-rl``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from rlcore.algorithms.sft.batches import conversation
from rlcore.cli.app import app
from rlcore.config import ConfigError, resolve
from rlcore.datasets import SampleBuilder
from rlcore.nemo_rl import load_nemo_rl_config, load_nemo_rl_dict

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "nemo_rl"
CONFIGS = sorted(FIXTURES.glob("*/sft.yaml"))
MAIN = FIXTURES / "main" / "sft.yaml"
FLAT = FIXTURES / "v0.4.0" / "sft.yaml"  # the early releases' flat data section
TINY = ["policy.model_name=tiny-llama"]
runner = CliRunner()


def _id(path: Path) -> str:
    return path.parent.name


def _flat(path: Path) -> bool:
    return path.parent.name in ("v0.4.0", "v0.5.0")


@pytest.fixture
def rows(tmp_path: Path) -> Path:
    """Chat rows as NeMo-RL's ResponseDataset and OpenAI-format datasets both read them (a 'messages' log)."""
    path = tmp_path / "chat.jsonl"
    logs = [
        [{"role": "user", "content": f"reverse {w}"}, {"role": "assistant", "content": w[::-1]}]
        for w in ("abc", "bcd", "cab", "dab", "abd", "bad", "cad", "dca")
    ]
    path.write_text("".join(json.dumps({"messages": log}) + "\n" for log in logs))
    return path


def local_data(path: Path, rows: Path) -> list[str]:
    """The NeMo-RL overrides that give a fixture's squad (which NeMo-RL downloads) as local files."""
    if _flat(path):  # ResponseDataset, as the early releases name its files
        return ["data.dataset_name=ResponseDataset", f"++data.train_data_path={rows}", f"++data.val_data_path={rows}"]
    return [f"++data.train.data_path={rows}", f"++data.validation.data_path={rows}"]


def nemo_sft(path: Path, rows: Path, overrides: Sequence[str] = ()) -> Any:
    return load_nemo_rl_config(path, [*local_data(path, rows), *TINY, *overrides], ["cluster.use_gpu=false"])


def problems_of(path: Path, overrides: Sequence[str]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_nemo_rl_config(path, [*TINY, *overrides])
    return info.value.problems


def _leaves(node: Any, prefix: str = "") -> list[str]:
    if not isinstance(node, dict) or not node:
        return [prefix]
    return [leaf for key, value in node.items() for leaf in _leaves(value, f"{prefix}.{key}" if prefix else key)]


def _unaccounted(nemo: dict[str, Any], conversion: Any) -> list[str]:
    """The NeMo-RL keys that are neither mapped (an rlcore value's source) nor ignored, nor under such a key."""
    places = {path.split(" (")[0] for path, _ in conversion.ignored}
    places |= {
        part for source in conversion.sources.values() if "(" not in source for part in re.split(r", | - ", source)
    }
    return [leaf for leaf in _leaves(nemo) if not any(leaf == p or leaf.startswith(p + ".") for p in places)]


# --- NeMo-RL's sft.yaml, main and four releases ---------------------------------------------------------------


def test_the_fixtures_are_nemo_rls_sft_yaml_of_main_and_four_releases():
    assert [p.parent.name for p in CONFIGS] == ["main", "v0.4.0", "v0.5.0", "v0.6.0", "v0.7.0"]
    for path in CONFIGS:
        assert "from https://github.com/NVIDIA-NeMo/RL at " in path.read_text().splitlines()[1]


@pytest.mark.parametrize("path", CONFIGS, ids=_id)
def test_nemo_rls_sft_yaml_is_an_sft_run_with_its_values(path: Path, rows: Path):
    loaded = nemo_sft(path, rows)
    cfg, converted = loaded.config, loaded.conversion.config
    assert cfg.algorithm == "sft"
    s = cfg.sft
    assert (
        s.max_num_steps,
        s.max_num_epochs,
        s.val_period,
        s.val_batches,
        s.val_global_batch_size,
        s.val_micro_batch_size,
        s.val_at_start,
        s.val_at_end,
        s.seed,
        s.only_unmask_final,
    ) == (60, 1, 10, 8, 32, 1, True, False, 42, False)
    assert (s.add_bos, s.add_eos, s.add_generation_prompt) == (True, True, False)  # NeMo-RL's data.add_*
    ck = cfg.checkpointing
    assert (ck.metric_name, ck.higher_is_better, ck.keep_last, ck.save_every_n_steps) == (
        "validation/loss",
        False,
        3,
        10,
    )  # val:val_loss
    assert cfg.data.train.path == cfg.data.validation.path == str(rows)
    assert (cfg.data.train.split, cfg.data.validation.split) == (None, None)  # squad's splits; a .jsonl has one
    assert (cfg.data.messages_key, cfg.data.input_key, cfg.data.output_key) == ("messages", "input", "output")
    assert cfg.policy.training_backend == "dtensor" and cfg.policy.tokenizer.chat_template.startswith("{% for")
    # no GRPO section comes out of the conversion: an rlcore SFT config refuses them
    assert not {"grpo", "loss", "env"} & set(converted) and "generation" not in converted["policy"]
    resolve(cfg, run=True)  # the batch plan of the run, validation batches included
    lines = loaded.ignored_lines()
    assert len(lines) == len(set(lines))
    assert cfg.data.max_input_seq_length == converted["data"].get("max_input_seq_length")  # NeMo-RL's rule, as is


@pytest.mark.parametrize("path", CONFIGS, ids=_id)
def test_every_key_of_nemo_rls_sft_yaml_is_mapped_or_ignored(path: Path, rows: Path):
    overrides = [*local_data(path, rows), *TINY]
    conversion = nemo_sft(path, rows).conversion
    assert conversion.problems == []
    assert _unaccounted(load_nemo_rl_dict(path, overrides), conversion) == []


def test_validate_from_nemo_rl_on_the_command_line(rows: Path):
    result = runner.invoke(
        app,
        [
            "config",
            "validate",
            "--from",
            "nemo-rl",
            str(MAIN),
            *local_data(MAIN, rows),
            *TINY,
            "-o",
            "cluster.use_gpu=false",
        ],
    )
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"OK: {MAIN} (NeMo-RL config")
    assert (
        "ignored: data.default.processor (rlcore's SFT tokenizes each row as NeMo-RL's sft_processor does)"
        in result.stderr
    )
    # a name rlcore does not know (squad it maps to the hub), the line says which override gives local rows
    result = runner.invoke(
        app, ["config", "validate", "--from", "nemo-rl", str(MAIN), *TINY, "data.train.dataset_name=my_squad"]
    )
    assert result.exit_code == 1
    assert (
        "data.train.dataset_name: is 'my_squad', a dataset rlcore does not know by name (docs/nemo-rl-mapping.md "
        "lists those it does); give its rows as a local file: ++data.train.data_path=/path/to/train.jsonl"
        in result.stderr
    )


# --- the rows: ResponseDataset and OpenAI format ------------------------------------------------------------


def test_response_dataset_entries_give_the_keys_of_both_splits(tmp_path: Path):
    path = tmp_path / "qa.jsonl"
    path.write_text(json.dumps({"question": "2+2?", "answer": "4"}) + "\n")
    cfg = load_nemo_rl_config(
        MAIN,
        [
            *TINY,
            "data.train.dataset_name=ResponseDataset",
            f"++data.train.data_path={path}",
            "++data.train.split_validation_size=0.5",
            "++data.train.seed=${sft.seed}",
            "data.validation=null",
            "++data.default.input_key=question",
            "++data.default.output_key=answer",
        ],
    ).config
    assert (cfg.data.input_key, cfg.data.output_key, cfg.data.split_validation_size) == ("question", "answer", 0.5)
    sample = SampleBuilder(cfg.data).sample({"question": "2+2?", "answer": "4"}, 0, "row 1")
    assert conversation(sample) == [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]


def test_openai_format_rows_of_the_early_releases(tmp_path: Path):
    path = tmp_path / "chats.jsonl"
    log = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    path.write_text(json.dumps({"conversation": log}) + "\n")
    loaded = load_nemo_rl_config(
        FLAT,
        [
            *TINY,
            "data.dataset_name=openai_format",
            f"++data.train_data_path={path}",
            f"++data.val_data_path={path}",
            "++data.chat_key=conversation",
            "++data.system_key=null",
            "++data.system_prompt=Be brief.",
            "++data.tool_key=null",
            "++data.use_preserving_dataset=false",
        ],
    )
    data = loaded.config.data
    assert (data.messages_key, data.system_prompt, data.validation.path) == ("conversation", "Be brief.", str(path))
    sample = SampleBuilder(data).sample({"conversation": log}, 0, "row 1")
    assert conversation(sample) == [{"role": "system", "content": "Be brief."}, *log]
    assert "ignored: data.tool_key (null: tool definitions" in "\n".join(loaded.ignored_lines())


# --- what stays an error ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, line",
    [
        (
            ["data.default.processor=math_hf_data_processor"],
            "data.default.processor: is 'math_hf_data_processor', but rlcore's SFT tokenizes each row as NeMo-RL's "
            "sft_processor does: set it to sft_processor",
        ),
        (
            ["++data.default.tool_key=tools"],
            "data.default.tool_key: is 'tools', but rlcore does not support tool definitions",
        ),
        (
            ["++data.train.system_key=system"],
            "data.train.system_key: is 'system', but rlcore does not support a system message from a column of the row",
        ),
        (
            ["++data.validation.input_key=question"],
            "data.validation.input_key: data.train's is 'input', "
            "data.validation's 'question'; rlcore reads both splits with one",
        ),
        (
            ["checkpointing.metric_name=val:accuracy"],
            "checkpointing.metric_name: is 'val:accuracy'; rlcore ranks SFT checkpoints by val:val_loss",
        ),
        (["++sft.new_feature=3"], "sft.new_feature: is 3, a NeMo-RL key rlcore's reader does not know"),
        (
            ["++checkpointing.pretrained_checkpoint.path=/ckpt"],
            'checkpointing.pretrained_checkpoint: is {"path": "/ckpt"}, but rlcore does not support loading Megatron',
        ),
        (
            ["++data.train_data_path=/x.jsonl"],
            "data.train_data_path: is '/x.jsonl', but NeMo-RL (since v0.6) reads a "
            "dataset's keys from data.train / data.validation",
        ),
    ],
    ids=[
        "processor",
        "tools",
        "system_key",
        "row_keys",
        "metric",
        "unknown",
        "pretrained",
        "moved_key",
    ],
)
def test_what_rlcore_does_not_do_stays_an_error(rows: Path, overrides: list[str], line: str):
    (problem,) = problems_of(MAIN, [*local_data(MAIN, rows), *overrides])
    assert problem.startswith(line), problem


def test_a_prompt_file_is_refused_for_message_logs(rows: Path, tmp_path: Path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Q: {}")
    (problem,) = problems_of(
        FLAT,
        [
            *local_data(FLAT, rows),
            "data.dataset_name=openai_format",
            "++data.tool_key=null",
            f"data.prompt_file={prompt}",
        ],
    )
    assert problem.startswith("data.prompt_file: is set, but data.dataset_name is 'openai_format'"), problem
    cfg = nemo_sft(FLAT, rows, [f"data.prompt_file={prompt}"]).config  # ResponseDataset rows: it formats inputs
    assert cfg.data.prompt_file == str(prompt)


# --- GRPO's sections and NeMo-RL's defaults ---------------------------------------------------------------


def test_grpo_sections_of_an_sft_config_are_ignored_as_nemo_rls_sft_ignores_them(rows: Path):
    loaded = nemo_sft(
        MAIN,
        rows,
        [
            "++loss_fn.ratio_clip_min=0.3",
            "++env.math.num_workers=2",
            "++grpo=null",
            "++policy.generation.backend=vllm",
            "++policy.generation.vllm_cfg.kv_cache_dtype=fp8",
        ],
    )
    converted = loaded.conversion.config
    assert not {"grpo", "loss", "env"} & set(converted) and "generation" not in converted["policy"]
    ignored = "\n".join(loaded.ignored_lines())
    for path in ("loss_fn", "env", "policy.generation"):
        assert f"ignored: {path} (NeMo-RL's SFT " in ignored


def test_absent_sft_keys_take_nemo_rls_defaults(rows: Path):
    s = nemo_sft(MAIN, rows, ["~sft.seed", "~sft.val_period", "~sft.val_at_start", "~sft.val_batches"]).config.sft
    assert (s.seed, s.val_period, s.val_at_start, s.val_batches) == (42, 10, True, 8)


def test_a_grpo_config_is_read_as_before():
    """data.add_bos and friends belong to SFT; a GRPO config's data is tasks.py's, as it was."""
    grpo = FIXTURES / "v0.7.0" / "grpo_math_1B.yaml"
    cfg = load_nemo_rl_config(grpo, [f"++data.train.data_path={FIXTURES / 'math.jsonl'}", "++data.add_bos=true"]).config
    assert cfg.algorithm == "grpo" and cfg.sft is None and cfg.checkpointing.metric_name == "validation/accuracy"


# --- one real run -------------------------------------------------------------------------------------------


def test_rlcore_run_from_nemo_rl_trains_sft_on_squad_from_the_hub_cache(tmp_path: Path):
    """NeMo-RL's own sft.yaml (main) as a user runs it, offline: no data override, its squad read from a hub cache
    built here (rajpurkar/squad as the hub holds it); only the model and the sizes a CPU needs are changed."""
    from tests.datasets.test_hub_formats import squad_cache

    home = tmp_path / "hf"
    squad_cache(home)
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    for name in ("HF_HUB_CACHE", "HF_DATASETS_CACHE"):
        env.pop(name, None)
    nemo_overrides = [
        *TINY,
        "cluster.gpus_per_node=2",
        "policy.precision=float32",
        "policy.train_global_batch_size=4",
        "policy.train_micro_batch_size=2",
        "policy.max_total_sequence_length=96",
        "sft.max_num_steps=2",
        "sft.val_global_batch_size=4",
        "sft.val_micro_batch_size=2",
        "sft.val_batches=1",
        "checkpointing.enabled=false",
        f"logger.log_dir={tmp_path / 'run'}",
    ]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlcore",
            "run",
            "--from",
            "nemo-rl",
            str(MAIN),
            *nemo_overrides,
            "-o",
            "cluster.use_gpu=false",
            "-o",
            "logger.progress_bar=false",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["first_loss"] > 0 and summary["last_loss"] > 0
    assert summary["first_validation_loss"] > 0  # sft.val_at_start: true
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [-1, 0, 1]
    assert logged[0]["validation/num_samples"] == 4  # sft.val_batches 1 × sft.val_global_batch_size 4
    assert all(r["num_valid_tokens"] > 0 for r in logged[1:])  # the assistant's tokens carry the loss
