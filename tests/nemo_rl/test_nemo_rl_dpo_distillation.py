"""Reading NeMo-RL's DPO and on-policy distillation configs: its own examples/configs/dpo.yaml and
distillation_math.yaml (main and the four releases), their local data, the teacher against the student, what
stays an error, and one real ``rlcore run --from nemo-rl`` of dpo.yaml."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from rlcore.algorithms.dpo.batches import preference_pair
from rlcore.cli.app import app
from rlcore.config import ConfigError, load_config, resolve
from rlcore.datasets import SampleBuilder
from rlcore.nemo_rl import load_nemo_rl_config, load_nemo_rl_dict

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "nemo_rl"
TAGS = ["main", "v0.4.0", "v0.5.0", "v0.6.0", "v0.7.0"]
DPO = sorted(FIXTURES.glob("*/dpo.yaml"))
DISTILLATION = sorted(FIXTURES.glob("*/distillation_math.yaml"))
DPO_MAIN = FIXTURES / "main" / "dpo.yaml"
DISTILLATION_MAIN = FIXTURES / "main" / "distillation_math.yaml"
TINY_DPO = ["policy.model_name=tiny-llama", "policy.tokenizer.name=${policy.model_name}"]
#: The tiny student and teacher, on one CPU rank each way: the example's parallel sizes are for 8 GPUs (the
#: teacher's own layout: tests/algorithms/test_distillation_full_vocabulary.py).
TINY_DISTILLATION = [
    "policy.model_name=tiny-llama",
    "teacher.model_name=tiny-teacher",
    "policy.dtensor_cfg.tensor_parallel_size=1",
    "policy.dtensor_cfg.context_parallel_size=1",
    "teacher.dtensor_cfg.tensor_parallel_size=${policy.dtensor_cfg.tensor_parallel_size}",
    "teacher.dtensor_cfg.context_parallel_size=${policy.dtensor_cfg.context_parallel_size}",
    "checkpointing.save_period=20",
]  # a multiple of distillation.val_period, which ranks the checkpoints
WORDS = ("abc", "bcd", "cab", "dab", "abd", "bad", "cad", "dca")
#: Keys the GRPO path (tasks.py, the cluster handler) reads without reporting them: null generation resources
#: while colocated, and data.default's keys, which it reads under the entry they fill in.
GRPO_PATH_SILENT = (
    "policy.generation.colocated.resources.",
    "data.default.",
    "data.prompt_file",
    "data.system_prompt_file",
)
runner = CliRunner()


def _id(path: Path) -> str:
    return path.parent.name


def _flat(path: Path) -> bool:
    return path.parent.name in ("v0.4.0", "v0.5.0")  # the early releases' flat data section


@pytest.fixture
def ranked(tmp_path: Path) -> Path:
    """Preference rows as NeMo-RL's PreferenceDataset reads them (and formats HelpSteer3's): a 'context' log and
    ranked 'completions'."""
    path = tmp_path / "ranked.jsonl"
    rows = [
        {
            "context": [{"role": "user", "content": f"reverse {w}"}],
            "completions": [
                {"rank": 1, "completion": [{"role": "assistant", "content": w}]},
                {"rank": 0, "completion": [{"role": "assistant", "content": w[::-1]}]},
            ],
        }
        for w in WORDS
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture
def binary(tmp_path: Path) -> Path:
    """Preference rows as NeMo-RL's BinaryPreferenceDataset reads them: prompt, chosen, rejected."""
    path = tmp_path / "binary.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"reverse {w}", "chosen": w[::-1], "rejected": w}) + "\n" for w in WORDS)
    )
    return path


@pytest.fixture
def problems_file(tmp_path: Path) -> Path:
    """Math rows with DeepScaler's columns (problem, answer), the dataset distillation_math.yaml names."""
    path = tmp_path / "math.jsonl"
    path.write_text(
        "".join(
            json.dumps({"problem": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n"
            for a in range(4)
            for b in range(4)
        )
    )
    return path


def dpo_data(path: Path, rows: Path) -> list[str]:
    """The NeMo-RL overrides that give a fixture's HelpSteer3 (which NeMo-RL downloads) as a local file."""
    if _flat(path):  # PreferenceDataset, as the early releases name its files
        return ["data.dataset_name=PreferenceDataset", f"++data.train_data_path={rows}", f"++data.val_data_path={rows}"]
    return [f"++data.train.data_path={rows}", f"++data.validation.data_path={rows}"]


def distillation_data(path: Path, rows: Path) -> list[str]:
    """DeepScaler and AIME2024 as local files, without the example's prompt file (a path in NeMo-RL's tree)."""
    if _flat(path):
        return [f"++data.data_path={rows}", f"++data.val_data_path={rows}", "data.prompt_file=null"]
    return [f"++data.train.data_path={rows}", f"++data.validation.data_path={rows}", "data.default.prompt_file=null"]


def nemo_dpo(path: Path, rows: Path, overrides: Sequence[str] = ()) -> Any:
    return load_nemo_rl_config(path, [*dpo_data(path, rows), *TINY_DPO, *overrides], ["cluster.use_gpu=false"])


def nemo_distillation(path: Path, rows: Path, overrides: Sequence[str] = ()) -> Any:
    return load_nemo_rl_config(
        path, [*distillation_data(path, rows), *TINY_DISTILLATION, *overrides], ["cluster.use_gpu=false"]
    )


def problems_of(path: Path, overrides: Sequence[str]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_nemo_rl_config(path, overrides)
    return info.value.problems


def unaccounted(path: Path, overrides: Sequence[str], conversion: Any) -> list[str]:
    """The NeMo-RL keys that are neither mapped (an rlcore value's source) nor ignored, nor under such a key."""

    def leaves(node: Any, prefix: str = "") -> list[str]:
        if not isinstance(node, dict) or not node:
            return [prefix]
        return [leaf for key, value in node.items() for leaf in leaves(value, f"{prefix}.{key}" if prefix else key)]

    places = {p.split(" (")[0] for p, _ in conversion.ignored}
    places |= {
        part for source in conversion.sources.values() if "(" not in source for part in re.split(r", | - ", source)
    }
    return [
        leaf
        for leaf in leaves(load_nemo_rl_dict(path, overrides))
        if not any(leaf == p or leaf.startswith(p + ".") for p in places)
    ]


def test_the_fixtures_are_nemo_rls_dpo_and_distillation_configs_of_main_and_four_releases():
    assert [_id(p) for p in DPO] == [_id(p) for p in DISTILLATION] == TAGS
    for path in DPO + DISTILLATION:
        assert "from https://github.com/NVIDIA-NeMo/RL at " in path.read_text().splitlines()[1]


# --- NeMo-RL's dpo.yaml ------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", DPO, ids=_id)
def test_nemo_rls_dpo_yaml_is_a_dpo_run_with_its_values(path: Path, ranked: Path):
    loaded = nemo_dpo(path, ranked)
    cfg, converted = loaded.config, loaded.conversion.config
    assert cfg.algorithm == "dpo"
    d = cfg.dpo
    assert (
        d.max_num_steps,
        d.max_num_epochs,
        d.val_period,
        d.val_batches,
        d.val_global_batch_size,
        d.val_micro_batch_size,
        d.val_at_start,
        d.val_at_end,
        d.seed,
    ) == (150, 1, 25, 8, 8, 1, True, False, 42)
    assert (
        d.reference_policy_kl_penalty,
        d.preference_loss_weight,
        d.sft_loss_weight,
        d.preference_average_log_probs,
        d.sft_average_log_probs,
    ) == (0.05, 1.0, 0.0, False, False)
    assert (d.add_bos, d.add_eos, d.add_generation_prompt) == (True, True, False)  # how NeMo-RL tokenizes pairs
    ck = cfg.checkpointing
    assert (ck.metric_name, ck.higher_is_better, ck.keep_last, ck.save_every_n_steps) == (
        "validation/loss",
        False,
        3,
        50,
    )  # val:validation-default_loss
    assert cfg.data.train.path == cfg.data.validation.path == str(ranked)
    assert (cfg.data.train.split, cfg.data.messages_key) == (None, "context")
    p = cfg.policy
    assert (
        p.training_backend,
        p.train_global_batch_size,
        p.train_micro_batch_size,
        p.max_total_sequence_length,
        p.precision,
        p.learning_rate,
        p.max_grad_norm,
    ) == ("dtensor", 128, 2, 1024, "bfloat16", 5.0e-6, 1.0)
    assert not {"grpo", "loss", "env"} & set(converted) and "generation" not in converted["policy"]
    resolve(cfg, run=True)  # the batch plan of the run (pairs), validation batches included
    lines = loaded.ignored_lines()
    assert len(lines) == len(set(lines))
    # a row reads as NeMo-RL's preference preprocessor reads it: the context, then the lower rank
    row = json.loads(ranked.read_text().splitlines()[0])
    prompt, chosen, rejected = preference_pair(SampleBuilder(cfg.data).sample(row, 0, "row 1"), "data.train")
    assert (prompt, chosen, rejected) == (
        row["context"],
        [{"role": "assistant", "content": "cba"}],
        [{"role": "assistant", "content": "abc"}],
    )


@pytest.mark.parametrize("path", DPO, ids=_id)
def test_every_key_of_nemo_rls_dpo_yaml_is_mapped_or_ignored(path: Path, ranked: Path):
    conversion = nemo_dpo(path, ranked).conversion
    assert conversion.problems == []
    assert unaccounted(path, [*dpo_data(path, ranked), *TINY_DPO], conversion) == []


def test_binary_rows_give_the_prompt_key(tmp_path: Path):
    path = tmp_path / "qa.jsonl"
    path.write_text(json.dumps({"question": "2+2?", "chosen": "4", "rejected": "5"}) + "\n")
    loaded = load_nemo_rl_config(
        DPO_MAIN,
        [
            *TINY_DPO,
            f"++data.train.data_path={path}",
            f"++data.validation.data_path={path}",
            "++data.default.dataset_name=BinaryPreferenceDataset",
            "~data.train.dataset_name",
            "~data.validation.dataset_name",
            "++data.default.prompt_key=question",
            "++data.default.chosen_key=chosen",
        ],
    )
    data = loaded.config.data
    assert (data.input_key, data.messages_key) == ("question", "messages")
    sample = SampleBuilder(data).sample({"question": "2+2?", "chosen": "4", "rejected": "5"}, 0, "row 1")
    assert preference_pair(sample, "data.train") == (
        [{"role": "user", "content": "2+2?"}],
        [{"role": "assistant", "content": "4"}],
        [{"role": "assistant", "content": "5"}],
    )
    assert loaded.conversion.sources["data.input_key"] == "data.default.dataset_name, data.default.prompt_key"
    assert "ignored: data.default.chosen_key (rlcore reads the 'chosen' column)" in loaded.ignored_lines()


def test_val_data_paths_replace_the_validation_set_and_name_its_metrics(ranked: Path, binary: Path):
    cfg = load_nemo_rl_config(
        DPO_MAIN,
        [
            *TINY_DPO,
            f"++data.train.data_path={binary}",
            "data.train.dataset_name=BinaryPreferenceDataset",
            f"++data.val_data_paths.heldout={ranked}",
            "checkpointing.metric_name=val:validation-heldout_accuracy",
            "checkpointing.higher_is_better=true",
        ],
    )
    loaded = cfg
    data, ck = loaded.config.data, loaded.config.checkpointing
    assert (data.train.path, data.validation.path) == (str(binary), str(ranked))
    assert (data.input_key, data.messages_key) == ("prompt", "context")  # binary train rows, ranked validation rows
    assert (ck.metric_name, ck.higher_is_better) == ("validation/accuracy", True)
    assert "ignored: data.validation (data.val_data_paths replaces it, as in NeMo-RL)" in loaded.ignored_lines()


def test_grpo_sections_and_tokens_of_a_dpo_config_are_ignored_as_nemo_rls_dpo_ignores_them(ranked: Path):
    loaded = nemo_dpo(
        DPO_MAIN,
        ranked,
        [
            "++loss_fn.ratio_clip_min=0.3",
            "++env.math.num_workers=2",
            "++policy.generation.backend=vllm",
            "++data.add_generation_prompt=true",
            "++dpo.preference_loss=dpo",
            "++dpo.gt_reward_scale=1.0",
        ],
    )
    cfg, converted = loaded.config, loaded.conversion.config
    assert cfg.dpo.add_generation_prompt is False and cfg.policy.generation is None
    assert not {"grpo", "loss", "env"} & set(converted)
    ignored = "\n".join(loaded.ignored_lines())
    for path in ("loss_fn", "env", "policy.generation"):
        assert f"ignored: {path} (NeMo-RL's DPO " in ignored
    assert "ignored: data.add_generation_prompt (NeMo-RL's DPO does not read it" in ignored
    assert "ignored: dpo.preference_loss (preference losses other than DPO" in ignored
    assert "ignored: dpo.gt_reward_scale (RPO's reward scale" in ignored


def test_absent_dpo_keys_take_nemo_rls_defaults(ranked: Path):
    d = nemo_dpo(DPO_MAIN, ranked, ["~dpo.seed", "~dpo.val_period", "~dpo.val_at_start", "~dpo.val_batches"]).config.dpo
    assert (d.seed, d.val_period, d.val_at_start, d.val_batches) == (42, 25, True, 8)


@pytest.mark.parametrize("path", [DPO_MAIN, FIXTURES / "v0.4.0" / "dpo.yaml"], ids=_id)
def test_a_dataset_rlcore_does_not_know_by_name_needs_a_local_file(path: Path):
    where, override = ("data", "train_data_path") if _flat(path) else ("data.train", "train.data_path")
    problems = problems_of(path, [*TINY_DPO, f"{where}.dataset_name=MyPreferences"])
    assert problems[0].startswith(
        f"{where}.dataset_name: is 'MyPreferences', a dataset rlcore does not know by name "
        "(docs/nemo-rl-mapping.md lists those it does); give its rows as a local file: "
        f"++data.{override}=/path/to/train.jsonl (NeMo-RL's PreferenceDataset rows: a "
        "'context' message log and ranked 'completions'"
    ), problems


@pytest.mark.parametrize(
    "overrides, line",
    [
        (
            ["data.train.dataset_name=BinaryPreferenceDataset", "++data.train.chosen_key=good"],
            "data.train.chosen_key: is 'good', but rlcore reads a binary row's responses from its 'chosen' and "
            "'rejected' columns",
        ),
        (
            ["data.train.dataset_name=my_pkg.MyPairs"],
            "data.train.dataset_name: is 'my_pkg.MyPairs', a dataset rlcore does not read",
        ),
        (
            ["++data.default.prompt_file=/p.txt"],
            "data.default.prompt_file: is set, but data.train.dataset_name names message-log rows ('context')",
        ),
        (
            ["checkpointing.metric_name=val:accuracy"],
            "checkpointing.metric_name: is 'val:accuracy'; rlcore ranks DPO checkpoints by val:validation-default_loss",
        ),
        (
            ["++dpo.preference_loss=ipo"],
            "dpo.preference_loss: is 'ipo', but rlcore does not support preference losses other than DPO",
        ),
        (["++dpo.new_option=3"], "dpo.new_option: is 3, a NeMo-RL key rlcore's reader does not know"),
        (
            ["++data.val_data_paths.a=/a.jsonl", "++data.val_data_paths.b=/b.jsonl", "checkpointing.metric_name=null"],
            "data.val_data_paths: names 2 validation sets; an rlcore run validates on one file",
        ),
        (
            ["++data.train.subset=pairs"],
            "data.train.subset: is 'pairs', but rlcore does not support Hugging Face dataset subsets",
        ),
    ],
    ids=[
        "chosen_key",
        "dataset_class",
        "prompt_file",
        "metric",
        "preference_loss",
        "unknown",
        "val_data_paths",
        "subset",
    ],
)
def test_what_rlcore_does_not_do_stays_an_error(ranked: Path, overrides: list[str], line: str):
    (problem,) = problems_of(DPO_MAIN, [*TINY_DPO, *dpo_data(DPO_MAIN, ranked), *overrides])
    assert problem.startswith(line), problem


def test_validate_dpo_from_nemo_rl_on_the_command_line(ranked: Path):
    result = runner.invoke(
        app,
        [
            "config",
            "validate",
            "--from",
            "nemo-rl",
            str(DPO_MAIN),
            *dpo_data(DPO_MAIN, ranked),
            *TINY_DPO,
            "-o",
            "cluster.use_gpu=false",
        ],
    )
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"OK: {DPO_MAIN} (NeMo-RL config")
    assert "ignored: data.train.split (a .jsonl file holds one split" in result.stderr


def test_rlcore_run_from_nemo_rl_trains_dpo_on_local_pairs(binary: Path, tmp_path: Path):
    """NeMo-RL's own dpo.yaml (main), the model swapped for the tiny local one and HelpSteer3 for local pairs."""
    nemo_overrides = [
        *TINY_DPO,
        f"++data.train.data_path={binary}",
        f"++data.validation.data_path={binary}",
        "++data.default.dataset_name=BinaryPreferenceDataset",
        "~data.train.dataset_name",
        "~data.validation.dataset_name",
        "policy.precision=float32",
        "policy.train_global_batch_size=4",
        "policy.train_micro_batch_size=2",
        "policy.max_total_sequence_length=64",
        "dpo.max_num_steps=2",
        "dpo.val_global_batch_size=4",
        "dpo.val_micro_batch_size=2",
        "dpo.val_batches=1",
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
            str(DPO_MAIN),
            *nemo_overrides,
            "-o",
            "cluster.use_gpu=false",
            "-o",
            "logger.progress_bar=false",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ignored: data.train.split (a .jsonl file holds one split" in out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["first_validation_accuracy"] == 0.0  # the policy is the reference
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [-1, 0, 1]  # dpo.val_at_start: true
    assert logged[0]["validation/num_pairs"] == 4  # dpo.val_batches 1 × dpo.val_global_batch_size 4
    assert abs(logged[1]["loss"] - 0.6931) < 1e-3  # -log sigmoid(0) before the first update
    assert all(r["cut_pairs"] == 0 for r in logged[1:])


# --- NeMo-RL's distillation_math.yaml ---------------------------------------------------------------------


@pytest.mark.parametrize("path", DISTILLATION, ids=_id)
def test_nemo_rls_distillation_yaml_is_a_distillation_run_with_its_values(path: Path, problems_file: Path):
    loaded = nemo_distillation(path, problems_file)
    cfg, converted = loaded.config, loaded.conversion.config
    nemo = load_nemo_rl_dict(path, [*distillation_data(path, problems_file), *TINY_DISTILLATION])
    assert cfg.algorithm == "distillation"
    d = cfg.distillation
    assert {key: getattr(d, key) for key in nemo["distillation"]} == nemo["distillation"]
    assert (d.kl_type, d.mixed_kl_weight, d.zero_outside_topk) == ("mixed", 0.5, False)  # loss_fn's
    assert d.teacher_model_name == "tiny-teacher" and d.val_at_end is False
    p, g = cfg.policy, cfg.policy.generation
    assert (
        p.training_backend,
        p.train_global_batch_size,
        p.train_micro_batch_size,
        p.logprob_batch_size,
        p.max_total_sequence_length,
        p.dynamic_batching.enabled,
    ) == ("dtensor", 64, 1, 1, 8192, True)
    assert (g.backend, g.max_new_tokens, g.temperature) == ("vllm", 8192, 1.0)
    assert (cfg.data.input_key, cfg.data.output_key, cfg.data.train.path) == ("problem", "answer", str(problems_file))
    assert (cfg.env.name, cfg.env.num_workers) == ("math", 8)
    assert (cfg.checkpointing.metric_name, cfg.checkpointing.higher_is_better) == ("validation/accuracy", True)
    assert not {"grpo", "loss"} & set(converted)
    resolved = resolve(cfg, run=True)
    assert resolved.teacher is not None and resolved.teacher.spec.name == "dtensor"
    lines = loaded.ignored_lines()
    assert len(lines) == len(set(lines))
    for key in ("generation", "optimizer", "scheduler", "tokenizer.name"):
        assert any(line.startswith(f"ignored: teacher.{key} (") for line in lines), key
    left = unaccounted(path, [*distillation_data(path, problems_file), *TINY_DISTILLATION], loaded.conversion)
    assert all(key.startswith(GRPO_PATH_SILENT) for key in left), left


def test_the_teacher_keeps_its_own_settings(problems_file: Path):
    """NeMo-RL's example gives its teacher tensor_parallel_size 4 (the student 2): the teacher's differing
    settings become its own (``distillation.teacher``), as written."""
    overrides = [
        *distillation_data(DISTILLATION_MAIN, problems_file),
        "policy.model_name=tiny-llama",
        "teacher.model_name=tiny-teacher",
        "teacher.precision=float32",
        "checkpointing.save_period=20",
    ]
    loaded = load_nemo_rl_config(DISTILLATION_MAIN, overrides)
    assert loaded.config.distillation.teacher == {
        "dtensor_cfg": {"tensor_parallel_size": 4},
        "make_sequence_length_divisible_by": 16,
        "precision": "float32",
    }
    assert loaded.config.policy.backend_sections["dtensor_cfg"]["tensor_parallel_size"] == 2


@pytest.mark.parametrize(
    "overrides, line",
    [
        (["teacher.model_name=null"], "teacher.model_name: is missing"),
        (["loss_fn.kl_type=js"], "distillation.kl_type (NeMo-RL: loss_fn.kl_type): "),
        (["++distillation.new_option=3"], "distillation.new_option: is 3, a NeMo-RL key rlcore's reader does not know"),
        (["++data.train.repeat=2"], "data.train.repeat: is 2, but rlcore reads each training row once per epoch"),
    ],
    ids=["no_teacher", "kl_type", "unknown", "repeat"],
)
def test_what_distillation_does_not_do_stays_an_error(problems_file: Path, overrides: list[str], line: str):
    (problem,) = problems_of(
        DISTILLATION_MAIN, [*distillation_data(DISTILLATION_MAIN, problems_file), *TINY_DISTILLATION, *overrides]
    )
    assert problem.startswith(line), problem


def test_what_nemo_rls_teacher_and_distillation_loss_do_not_read_is_ignored(problems_file: Path):
    loaded = nemo_distillation(
        DISTILLATION_MAIN,
        problems_file,
        [
            "teacher.generation.temperature=0.3",
            "teacher.optimizer.kwargs.lr=1.0",
            "teacher.tokenizer.name=gpt2",
            "++loss_fn.ratio_clip_min=0.3",
            "loss_fn.kl_type=forward",
            "~distillation.max_val_samples",
            "~distillation.seed",
        ],
    )
    cfg = loaded.config
    assert (cfg.distillation.kl_type, cfg.distillation.max_val_samples, cfg.distillation.seed) == ("forward", 512, 42)
    assert "loss" not in loaded.conversion.config
    assert cfg.policy.learning_rate == 2.0e-5 and cfg.policy.generation.temperature == 1.0
    ignored = "\n".join(loaded.ignored_lines())
    assert "ignored: loss_fn.ratio_clip_min (NeMo-RL's distillation loss reads only kl_type" in ignored
    assert "ignored: teacher.tokenizer.name (rlcore runs the teacher on the student's tokenizer, as NeMo-RL" in ignored
    assert "ignored: data.validation.repeat (rlcore validates greedily" in ignored


def test_the_teachers_anchored_copy_is_its_own(problems_file: Path):
    """The example's teacher is ``<<: *POLICY_BASE``: an override of the student's key leaves the teacher's as
    OmegaConf does (a copy, not an alias), so it then differs and is the teacher's own."""
    nemo = load_nemo_rl_dict(DISTILLATION_MAIN, ["policy.optimizer.kwargs.lr=1.0", "policy.precision=float32"])
    assert (nemo["teacher"]["optimizer"]["kwargs"]["lr"], nemo["teacher"]["precision"]) == (2.0e-5, "bfloat16")
    loaded = nemo_distillation(DISTILLATION_MAIN, problems_file, ["policy.precision=float32"])
    assert loaded.config.distillation.teacher == {"precision": "bfloat16"}


def test_a_teacher_section_in_another_algorithms_config_is_ignored():
    path = FIXTURES / "v0.7.0" / "grpo_math_1B.yaml"
    loaded = load_nemo_rl_config(path, [f"++data.train.data_path={FIXTURES / 'math.jsonl'}", "++teacher.model_name=x"])
    assert loaded.config.algorithm == "grpo" and loaded.config.distillation is None
    assert "ignored: teacher (only NeMo-RL's distillation reads it (this is a grpo config))" in loaded.ignored_lines()


# --- both ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["dpo", "distillation"])
def test_convert_writes_a_native_file_of_the_same_config(which: str, ranked: Path, problems_file: Path, tmp_path: Path):
    path, rows, data, tiny, read = {
        "dpo": (DPO_MAIN, ranked, dpo_data, TINY_DPO, nemo_dpo),
        "distillation": (DISTILLATION_MAIN, problems_file, distillation_data, TINY_DISTILLATION, nemo_distillation),
    }[which]
    out = tmp_path / "converted.yaml"
    result = runner.invoke(
        app, ["config", "convert", "--from", "nemo-rl", str(path), *data(path, rows), *tiny, "-o", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert load_config(out, ["cluster.use_gpu=false"]) == read(path, rows).config


def test_nemo_rls_cross_tokenizer_off_policy_teachers_are_refused_in_one_line(problems_file: Path):
    """NeMo-RL's cross-tokenizer path is another algorithm (off-policy, ``teachers`` each with a projection
    matrix): refused by its key alone, without a second line about the ``teacher`` it sets to null."""
    problems = problems_of(
        DISTILLATION_MAIN,
        [
            *distillation_data(DISTILLATION_MAIN, problems_file),
            *TINY_DISTILLATION,
            "teacher=null",
            "logger.wandb.name=x",
            "logger.swanlab.name=x",
            "++teachers=[{model_name: tiny-teacher, projection_matrix_path: m.pt}]",
        ],
    )
    assert len(problems) == 1 and problems[0].startswith("teachers: "), problems
    assert "cross-tokenizer off-policy distillation" in problems[0]


def test_the_teacher_s_env_vars_are_its_own_workers_(problems_file: Path):
    """NeMo-RL's teacher is a Policy of its own workers, its env_vars set there; rlcore's too (policy.env_vars)."""
    loaded = nemo_distillation(DISTILLATION_MAIN, problems_file, ["++teacher.dtensor_cfg.env_vars.FOO='1'"])
    assert loaded.config.distillation.teacher["env_vars"] == {"FOO": "1"}
    assert loaded.config.distillation.teacher_policy(loaded.config.policy)["env_vars"] == {"FOO": "1"}
