"""A run's samples: local files of every format, rows made into message logs, epochs, and bad data in one line."""

from __future__ import annotations

import json

import pytest

from rlcore.config import load_config_dict
from rlcore.datasets import DataError, DataExhausted, DatasetSource, SampleBuilder, load_sources, read_rows

ROWS = [{"id": f"r{i}", "problem": f"{i}+1=", "answer": str(i + 1)} for i in range(7)]


def _write(path, rows, fmt):
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    elif fmt == "csv":
        path.write_text("id,problem,answer\n" + "".join(f"{r['id']},{r['problem']},{r['answer']}\n" for r in rows))
    elif fmt == "parquet":
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet"])
def test_every_file_format_reads_the_same_rows(tmp_path, fmt):
    assert list(read_rows(_write(tmp_path / f"d.{fmt}", ROWS, fmt))) == ROWS


def test_a_datasets_directory_reads_its_arrow_files(tmp_path):
    """A directory datasets' save_to_disk wrote (a DatasetDict: a directory per split), read with datasets."""
    datasets = pytest.importorskip("datasets")
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS[:4]), "test": datasets.Dataset.from_list(ROWS[4:])}
    ).save_to_disk(str(tmp_path / "ds"))
    assert list(read_rows(tmp_path / "ds", "test")) == ROWS[4:]
    assert list(read_rows(tmp_path / "ds" / "train")) == ROWS[:4]
    with pytest.raises(DataError, match="holds the splits train, test: pick one with split"):
        read_rows(tmp_path / "ds")
    (tmp_path / "ds" / "train" / "state.json").write_text(json.dumps({"_data_files": [{"filename": "../../x.arrow"}]}))
    with pytest.raises(DataError, match="not readable by datasets.load_from_disk"):
        read_rows(tmp_path / "ds", "train")


def test_json_splits(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"train": ROWS[:2], "validation": ROWS[2:3]}))
    assert read_rows(path, "validation") == ROWS[2:3]
    with pytest.raises(DataError, match="no split 'test' \\(it has train, validation\\)"):
        read_rows(path, "test")


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "no rows"),
        (b'{"problem": "1"}\n{"problem": \n', r"d.jsonl: row 2: not JSON"),
        (b'{"problem": "1"}\n[1, 2]\n', r"d.jsonl: row 2: expected an object"),
        (b'{"problem": "1"}\n{"problem": "\xff"}\n', r"d.jsonl: line 2: not UTF-8"),
    ],
)
def test_bad_files_fail_in_one_line_naming_the_row(tmp_path, content, message):
    path = tmp_path / "d.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError, match=message) as info:
        read_rows(path)
    assert "\n" not in str(info.value)


def test_missing_file_and_unknown_format(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        read_rows(tmp_path / "nope.jsonl")
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(DataError, match="unknown format '.txt'"):
        read_rows(tmp_path / "d.txt")


def test_a_fifo_or_socket_is_refused_in_one_line_without_being_opened(tmp_path):
    """Opening a FIFO waits for a writer (forever, and before Ray a first SIGINT was lost in it): it is named for
    what it is from its status, never opened, as a data file and as a prompt file."""
    import os
    import socket
    import threading

    fifo = tmp_path / "rows.jsonl"
    os.mkfifo(fifo)
    done = threading.Event()

    def read() -> None:
        with pytest.raises(DataError) as err:
            read_rows(fifo)
        assert str(err.value) == (
            f"{fifo}: is a FIFO (named pipe), not a regular file; reading it could wait forever for a writer: give "
            "a data file (.jsonl, .json, .parquet, .csv) or a directory written by datasets' save_to_disk"
        )
        with pytest.raises(DataError) as err:
            SampleBuilder(_cfg(prompt_file=str(fifo)).data)
        assert (
            str(err.value) == f"data.prompt_file: {fifo} is a FIFO (named pipe), not a regular file; give a text file"
        )
        done.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=30)
    assert done.is_set(), "the FIFO was opened: the reader is blocked waiting for a writer"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(tmp_path / "rows.csv"))
        with pytest.raises(DataError, match=r"rows.csv: is a socket, not a regular file"):
            read_rows(tmp_path / "rows.csv")


def _cfg(**data):
    return load_config_dict(
        {"data": {"train": {"path": "unused.jsonl"}, "input_key": "problem", "output_key": "answer", **data}}
    )


def test_a_row_becomes_a_message_log_with_its_metadata(tmp_path):
    (tmp_path / "sys.txt").write_text("Think, then answer.")
    builder = SampleBuilder(
        _cfg(system_prompt_file=str(tmp_path / "sys.txt"), prompt_template="Solve {} (id {id})").data
    )
    sample = builder.sample(ROWS[2], 2, "d.jsonl: row 3")
    assert sample.messages == [
        {"role": "system", "content": "Think, then answer."},
        {"role": "user", "content": "Solve 2+1= (id r2)"},
    ]
    assert sample.metadata == {**ROWS[2], "ground_truth": "3"}
    chat = {"messages": [{"role": "user", "content": "hi"}], "answer": "yo", "topic": "greeting"}
    sample = SampleBuilder(_cfg(system_prompt="S").data).sample(chat, 0, "row 1")
    assert sample.messages == [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    assert sample.metadata == {"answer": "yo", "topic": "greeting", "ground_truth": "yo"}


@pytest.mark.parametrize(
    "row, data, message",
    [
        ({"question": "1+1"}, {}, r"d.jsonl: row 4: no field 'problem' \(data.input_key\); the row has question"),
        ({"problem": 5}, {}, r"row 4: field 'problem' is int, not text"),
        ({"problem": "1"}, {"prompt_template": "{unit}: {}"}, r"row 4: data.prompt_template names 'unit'"),
        ({"messages": [{"role": "robot", "content": "x"}]}, {}, r"row 4: field 'messages' message 1 needs a role"),
    ],
)
def test_bad_rows_name_the_file_row_and_field(row, data, message):
    with pytest.raises(DataError, match=message):
        SampleBuilder(_cfg(**data).data).sample(row, 3, "d.jsonl: row 4")


def test_epochs_cover_every_sample_once_reshuffled_and_reproducible():
    builder = SampleBuilder(_cfg().data)
    samples = [builder.sample(r, i, "") for i, r in enumerate(ROWS)]
    source = DatasetSource(samples, 3, seed=5, max_epochs=2)
    assert source.batches_per_epoch == 2 and source.total_batches == 4  # 7 rows: the 7th of each epoch waits
    epochs = [[s.idx for k in range(e * 2, e * 2 + 2) for s in source.batch(k)] for e in range(2)]
    assert all(len(set(e)) == 6 for e in epochs) and epochs[0] != epochs[1]
    again = DatasetSource(samples, 3, seed=5)  # a fresh source (a resumed run) gives batch k the same samples
    assert [s.idx for s in again.batch(3)] == [s.idx for s in source.batch(3)]
    assert [s.idx for s in DatasetSource(samples, 3, shuffle=False).batch(1)] == [3, 4, 5]
    with pytest.raises(DataExhausted, match=r"max_num_epochs=2: the 4 batches of 3 samples it allows are used up"):
        source.batch(4)  # what dynamic sampling's cursor meets when the epochs end inside a step
    with pytest.raises(DataError, match=r"7 samples, fewer than one batch's 8 \(grpo.num_prompts_per_step\)"):
        DatasetSource(samples, 8)


def test_load_sources_checks_every_prompt_fits_before_a_run(tmp_path):
    path = tmp_path / "d.jsonl"
    _write(path, [*ROWS[:3], {"problem": "x" * 40, "answer": "1"}], "jsonl")
    cfg = load_config_dict(
        {
            "data": {
                "train": {"path": str(path)},
                "validation": {"path": str(path)},
                "input_key": "problem",
                "output_key": "answer",
            },
            "grpo": {"num_prompts_per_step": 2, "max_val_samples": 2},
            "policy": {"max_total_sequence_length": 32},
        }
    )
    with pytest.raises(
        DataError,
        match=r"d.jsonl: row 4: the prompt is 41 tokens, which leaves no room for a "
        r"completion within policy.max_total_sequence_length=32",
    ):
        load_sources(cfg, lambda s: len(s.messages[-1]["content"]) + 1)
    data = load_sources(
        cfg.model_copy(update={"policy": cfg.policy.model_copy(update={"max_total_sequence_length": 64})}),
        lambda s: len(s.messages[-1]["content"]) + 1,
    )
    assert [s.idx for s in data.validation] == [0, 1] and data.train.batches_per_epoch == 2
    # a validation share held out of the train file is checked too (seed 0 holds out row 4 of 4)
    held = cfg.model_copy(
        update={"data": cfg.data.model_copy(update={"validation": None, "split_validation_size": 0.25})}
    )
    with pytest.raises(DataError, match=r"d.jsonl: row 4: the prompt is 41 tokens"):
        load_sources(held, lambda s: len(s.messages[-1]["content"]) + 1)


def test_config_rejects_ambiguous_data_sources():
    from rlcore.config import ConfigError

    with pytest.raises(ConfigError, match="data.train: .*give exactly one of path"):
        load_config_dict({"data": {"train": {"path": "a.jsonl", "generator": "m:f"}}})
    with pytest.raises(ConfigError, match="system_prompt and system_prompt_file: give one of them"):
        load_config_dict({"data": {"system_prompt": "a", "system_prompt_file": "b"}})


def test_dotted_keys_read_nested_fields_and_a_column_of_that_name_wins():
    builder = SampleBuilder(_cfg(input_key="q.text", output_key="meta.answer.value").data)
    sample = builder.sample({"q": {"text": "2+2="}, "meta": {"answer": {"value": "4"}}}, 0, "row 1")
    assert sample.messages == [{"role": "user", "content": "2+2="}] and sample.metadata["ground_truth"] == "4"
    flat = builder.sample({"q.text": "flat", "q": {"text": "nested"}}, 1, "row 2")
    assert flat.messages[0]["content"] == "flat" and "ground_truth" not in flat.metadata
    with pytest.raises(DataError, match=r"row 3: no field 'q.text' \(data.input_key\); the row has q"):
        builder.sample({"q": {"body": "x"}}, 2, "row 3")


def test_jsonl_lines_end_at_newline_only(tmp_path):
    """U+2028 and U+0085 are legal unescaped inside a JSON string (str.splitlines cuts at them); so are CRLF line
    ends. A form feed is written escaped and stays one."""
    rows = [
        {"problem": "a\u2028b", "answer": "1"},
        {"problem": "c\u0085d", "answer": "2"},
        {"problem": "e\x0cf", "answer": "3"},
    ]
    path = tmp_path / "odd.jsonl"
    path.write_bytes("\r\n".join(json.dumps(r, ensure_ascii=False) for r in rows).encode("utf-8") + b"\r\n")
    assert read_rows(path) == rows
    (tmp_path / "bad.jsonl").write_text('{"a": 1}\n{"a": \n')
    with pytest.raises(DataError, match="row 2: not JSON"):
        read_rows(tmp_path / "bad.jsonl")


def test_text_files_are_held_as_memory_mapped_arrow_with_each_row_as_written(tmp_path):
    """JSONL goes through datasets' cache (Arrow files, memory-mapped), yet each row keeps its own keys and value
    types, which a table's columns would fill in or refuse; a changed file is read again."""
    from rlcore.datasets.files import TextFileRows

    rows = [{"a": 1}, {"a": "x", "b": [1, {"c": None}]}, {"d": True}]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    read = read_rows(path)
    assert isinstance(read, TextFileRows) and read.table.cache_files
    assert [read[i] for i in range(3)] == rows and read[1:] == rows[1:]
    path.write_text(json.dumps({"a": 2}) + "\n")
    assert list(read_rows(path)) == [{"a": 2}]
