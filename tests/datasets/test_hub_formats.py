"""NeMo-RL's SFT and DPO dataset names (squad, HelpSteer3, OpenAssistant, Tulu3 preference, gsm8k): their row
formats against the rows NeMo-RL's classes make (nemo_rl/data/datasets, main 7ea279a, written out by hand here),
and NeMo-RL's sft.yaml / dpo.yaml converted and read offline from a hub cache built in a temporary HF_HOME."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlcore.cli.app import app
from rlcore.config.data import DataConfig, DatasetConfig
from rlcore.datasets import DataError, SampleBuilder
from rlcore.datasets.formats import FormattedRows, gsm8k, helpsteer3, squad, tulu3_preference
from rlcore.datasets.oasst import SYSTEM_PROMPT, tree_conversations
from rlcore.datasets.sources import read_samples
from rlcore.nemo_rl import load_nemo_rl_config
from tests.support.hub_cache import hub_cache, offline_home  # noqa: F401 (a fixture)

pytest.importorskip("datasets")
FIXTURES = Path(__file__).parents[1] / "fixtures" / "nemo_rl"
CPU = ["policy.model_name=tiny-llama"]


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def _assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def squad_rows(n: int) -> list[dict]:
    return [
        {
            "id": str(i),
            "title": "T",
            "context": f"Passage {i}.",
            "question": f"Which passage is {i}?",
            "answers": {"text": [f"passage {i}", "other"], "answer_start": [0, 3]},
        }
        for i in range(n)
    ]


def helpsteer_rows(n: int) -> list[dict]:
    return [
        {
            "domain": "general",
            "context": [_user(f"q{i}")],
            "response1": f"one{i}",
            "response2": f"two{i}",
            "overall_preference": (i % 5) - 2,
        }
        for i in range(n)
    ]


def test_squad_puts_the_passage_in_the_system_message_and_the_first_answer_last():
    row = squad_rows(1)[0]
    assert squad(row) == {
        "messages": [{"role": "system", "content": "Passage 0."}, _user("Which passage is 0?"), _assistant("passage 0")]
    }


@pytest.mark.parametrize(
    "preference, chosen, rejected", [(-3, "one", "two"), (-1, "one", "two"), (0, "one", "one"), (2, "two", "one")]
)
def test_helpsteer3_ranks_the_preferred_response_first(preference, chosen, rejected):
    row = {"context": "plain question", "response1": "one", "response2": "two", "overall_preference": preference}
    assert helpsteer3(row) == {
        "context": [_user("plain question")],
        "completions": [
            {"rank": 0, "completion": [_assistant(chosen)]},
            {"rank": 1, "completion": [_assistant(rejected)]},
        ],
    }


def test_tulu3_preference_splits_the_shared_context_from_the_last_answers():
    context = [_user("hi"), _assistant("hello"), _user("and?")]
    row = {"chosen": [*context, _assistant("good")], "rejected": [*context, _assistant("bad")]}
    assert tulu3_preference(row) == {
        "context": context,
        "completions": [
            {"rank": 0, "completion": [_assistant("good")]},
            {"rank": 1, "completion": [_assistant("bad")]},
        ],
    }
    with pytest.raises(ValueError, match="differ before their last message"):
        tulu3_preference({"chosen": [_user("a"), _assistant("x")], "rejected": [_user("b"), _assistant("y")]})


def test_gsm8k_keeps_what_follows_the_hashes():
    assert gsm8k({"question": "2+2?", "answer": "Two and two.\n#### 4"}) == {"question": "2+2?", "answer": "4"}


def test_a_row_the_format_cannot_read_is_one_line_naming_the_row():
    rows = FormattedRows(
        [{"context": "c", "question": "q", "answers": {"text": ["a"]}}, {"question": "q"}], "squad", "rajpurkar/squad"
    )
    assert rows[0]["messages"][-1] == _assistant("a")
    with pytest.raises(DataError, match=r"^rajpurkar/squad: row 2: not a squad row \(no column 'answers'\); the "):
        rows[1]


def test_oasst_trees_become_every_conversation_from_root_to_leaf(tmp_path: Path):
    def node(role: str, text: str, *replies: dict) -> dict:
        return {"role": role, "text": text, "replies": list(replies)}

    tree = {
        "message_tree_id": "t",
        "prompt": node("prompter", "Q", node("assistant", "A1", node("prompter", "Q2")), node("assistant", "A2")),
    }
    lone = {"message_tree_id": "u", "prompt": node("prompter", "unanswered")}  # one turn: dropped, as NeMo-RL does
    path = tmp_path / "trees.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps(tree) + "\n" + json.dumps(lone) + "\n")
    system = {"role": "system", "content": SYSTEM_PROMPT}
    expected = [[system, _user("Q"), _assistant("A1"), _user("Q2")], [system, _user("Q"), _assistant("A2")]]
    assert [row["messages"] for row in tree_conversations(str(path))] == expected
    samples = read_samples(DatasetConfig(path=str(path), format="oasst"), SampleBuilder(DataConfig()))
    assert [s.messages for s in samples] == expected


# --- NeMo-RL's sft.yaml and dpo.yaml, offline, from a hub cache ------------------------------------------------


def squad_cache(home: Path) -> None:
    """rajpurkar/squad as the hub holds it: subset plain_text, parquet train and validation splits."""
    hub_cache(
        home,
        "rajpurkar/squad",
        {
            "plain_text/train-00000-of-00001.parquet": squad_rows(12),
            "plain_text/validation-00000-of-00001.parquet": squad_rows(4),
        },
        configs={"plain_text": {"train": "plain_text/train-*", "validation": "plain_text/validation-*"}},
    )


def helpsteer_cache(home: Path) -> None:
    """nvidia/HelpSteer3 as the hub holds it: subsets preference and edit, jsonl.gz files per split."""
    hub_cache(
        home,
        "nvidia/HelpSteer3",
        {
            "preference/train.parquet": helpsteer_rows(10),
            "preference/validation.parquet": helpsteer_rows(3),
            "edit/train.parquet": [{"other": 1}],
        },
        configs={
            "preference": {"train": "preference/train.parquet", "validation": "preference/validation.parquet"},
            "edit": {"train": "edit/train.parquet"},
        },
    )


@pytest.mark.parametrize("release", ["v0.4.0", "v0.7.0", "main"])
def test_nemo_rls_sft_yaml_reads_squad_from_the_hub_cache(offline_home: Path, release: str):
    squad_cache(offline_home)
    data = load_nemo_rl_config(FIXTURES / release / "sft.yaml", CPU).config.data
    assert (data.train.hub_id, data.train.split, data.train.format) == ("rajpurkar/squad", "train", "squad")
    assert (data.validation.hub_id, data.validation.split) == ("rajpurkar/squad", "validation")
    builder = SampleBuilder(data)
    train, validation = read_samples(data.train, builder), read_samples(data.validation, builder, "data.validation")
    assert (len(train), len(validation)) == (12, 4)
    assert train[5].messages == squad(squad_rows(12)[5])["messages"]


@pytest.mark.parametrize("release", ["v0.4.0", "v0.7.0", "main"])
def test_nemo_rls_dpo_yaml_reads_helpsteer3_preferences_from_the_hub_cache(offline_home: Path, release: str):
    helpsteer_cache(offline_home)
    data = load_nemo_rl_config(FIXTURES / release / "dpo.yaml", CPU).config.data
    assert (data.train.hub_id, data.train.subset, data.train.format) == (
        "nvidia/HelpSteer3",
        "preference",
        "helpsteer3",
    )
    assert (data.validation.split, data.messages_key) == ("validation", "context")
    rows = helpsteer_rows(10)
    samples = read_samples(data.train, SampleBuilder(data))
    assert len(samples) == 10
    for i in (0, 2, 4):  # preference -2 (response1), 0 (response1 twice), 2 (response2)
        assert samples[i].messages == rows[i]["context"]
        assert samples[i].metadata["completions"] == helpsteer3(rows[i])["completions"]


def test_sft_openmathinstruct2_holds_out_what_nemo_rl_holds_out():
    data = load_nemo_rl_config(FIXTURES / "main" / "sft_openmathinstruct2.yaml", CPU).config.data
    assert (data.train.hub_id, data.train.split, data.input_key, data.output_key, data.split_validation_size) == (
        "nvidia/OpenMathInstruct-2",
        "train_1M",
        "problem",
        "generated_solution",
        0.05,
    )
    assert data.validation is None


def test_validate_offline_names_the_download_then_passes_with_the_cache(offline_home: Path):
    runner = CliRunner()
    args = [
        "config",
        "validate",
        "--from",
        "nemo-rl",
        str(FIXTURES / "main" / "sft.yaml"),
        *CPU,
        "-o",
        "cluster.use_gpu=false",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 1
    assert (
        "data.train.hub_id (NeMo-RL: data.train.dataset_name): rajpurkar/squad is not in the hub cache and the "
        "hub is off (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE); download it where the hub is reachable: hf download "
        "--repo-type dataset rajpurkar/squad"
    ) in result.stderr
    squad_cache(offline_home)
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output


def test_image_rows_are_rewritten_as_nemo_rls_vlm_loaders_do():
    from rlcore.datasets.formats import clevr_cogent, geometry3k

    assert clevr_cogent({"problem": "How many?", "image": "png", "solution": "<answer> 3 cubes </answer>"}) == {
        "problem": "How many?",
        "image": "png",
        "solution": "3 cubes",
    }
    assert clevr_cogent({"problem": "p", "image": "png", "solution": " plain "})["solution"] == "plain"
    row = geometry3k({"problem": "<image>Find x.", "images": ["first", "second"], "answer": "12"})
    assert row == {"problem": "Find x.", "images": ["first"], "answer": "12"}
