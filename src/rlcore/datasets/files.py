"""Rows from local files: JSONL, JSON, CSV, parquet, and directories written by Hugging Face ``datasets``.

Every problem is one :class:`DataError` line naming the file, the row (1-based: the line of a JSONL file) and
the field, so a bad row is found before anything starts. Every source is held by Hugging Face ``datasets`` as
memory-mapped Arrow, a row becoming a Python dict only when it is drawn: parquet files (``load_dataset``),
``save_to_disk`` directories (``load_from_disk``), and JSONL, JSON and CSV files, which are checked line by line
(an error names the line) as ``datasets`` writes them into its cache, each row kept as written.
"""

from __future__ import annotations

import csv
import json
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any


class DataError(ValueError):
    """A dataset problem, in one line naming the file, the row and the field, and the fix."""


def read_rows(path: str | Path, split: str | None = None) -> Sequence[dict[str, Any]]:
    """The rows of a local dataset file or ``datasets`` directory; ``split`` picks one of several."""
    path = Path(path).expanduser()
    if not path.exists():
        raise DataError(f"{path}: no such file or directory")
    if (kind := special_file_kind(path)) is not None:
        raise DataError(
            f"{path}: is {kind}, not a regular file; reading it could wait forever for a writer: give a data file "
            "(.jsonl, .json, .parquet, .csv) or a directory written by datasets' save_to_disk"
        )
    if path.is_dir():
        rows = _read_datasets_dir(path, split)
    else:
        suffix = path.suffix.lower()
        if suffix not in (*_TEXT_READERS, ".parquet"):
            raise DataError(
                f"{path}: unknown format '{path.suffix}'; use .jsonl, .json, .parquet, .csv or a "
                "directory written by datasets' save_to_disk"
            )
        if split is not None and suffix != ".json":
            raise DataError(f"{path}: split '{split}' given, but a {path.suffix} file holds one split")
        rows = _read_parquet(path) if suffix == ".parquet" else _read_text_file(path, split)
    if len(rows) == 0:
        raise DataError(f"{path}{f' (split {split})' if split else ''}: no rows")
    return rows


def special_file_kind(path: Path) -> str | None:
    """What ``path`` is when it is neither a regular file nor a directory (``'a FIFO (named pipe)'``), read from
    its status without opening it: opening a FIFO blocks until a writer comes."""
    mode = path.stat().st_mode
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    kinds = {
        stat.S_ISFIFO: "a FIFO (named pipe)",
        stat.S_ISSOCK: "a socket",
        stat.S_ISCHR: "a character device",
        stat.S_ISBLK: "a block device",
    }
    return next((name for test, name in kinds.items() if test(mode)), "a special file")


def _row(path: Path, number: int, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise DataError(f"{path}: row {number}: expected an object (key: value), got {type(value).__name__}")
    return value


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """The file's lines (1-based numbers), decoded as UTF-8. A line ends at '\\n' only: str.splitlines would also
    cut at U+2028 or U+0085, which a JSON string may hold unescaped. A '\\r' before the '\\n' is JSON whitespace."""
    offset = 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"{path}: line {number}: not UTF-8 (byte {offset + exc.start}); re-encode the file as UTF-8"
                ) from None
            offset += len(raw)


def _jsonl_rows(path: Path, split: str | None) -> Iterator[dict[str, Any]]:
    for number, line in _lines(path):
        if not line.strip():
            continue
        try:
            yield _row(path, number, json.loads(line))
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}: row {number}: not JSON ({exc.msg} at column {exc.colno})") from None


def _json_rows(path: Path, split: str | None) -> Iterator[dict[str, Any]]:
    """A .json file is one value: read whole (JSON cannot be read in parts), then written out row by row."""
    text = "".join(line for _, line in _lines(path))
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: line {exc.lineno}: not JSON ({exc.msg})") from None
    if isinstance(data, dict):
        if split is None:
            raise DataError(f"{path}: holds the splits {', '.join(map(str, data))}: pick one with split")
        if split not in data:
            raise DataError(f"{path}: no split '{split}' (it has {', '.join(map(str, data))})")
        data = data[split]
    elif split is not None:
        raise DataError(f"{path}: split '{split}' given, but the file is one list of rows")
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a list of rows, got {type(data).__name__}")
    for number, row in enumerate(data, 1):
        yield _row(path, number, row)


def _csv_rows(path: Path, split: str | None) -> Iterator[dict[str, Any]]:
    yield from (dict(row) for row in csv.DictReader((line for _, line in _lines(path))))


def _row_texts(path: str, reader: str, split: str | None, stamp: Any = None) -> Iterator[dict[str, str]]:
    """Each row of a JSONL / JSON / CSV file as the JSON text of the row (``stamp``: the file's size and time, which
    key ``datasets``' cache of it)."""
    for row in _TEXT_READERS[reader](Path(path), split):
        yield {"row": json.dumps(row, ensure_ascii=False)}


class TextFileRows(Sequence[dict[str, Any]]):
    """The rows of a JSONL, JSON or CSV file, kept by ``datasets`` as memory-mapped Arrow (one column: each row's JSON
    text), each row a dict only when read: every row stays as written (its own keys and value types, which a
    table's columns would fill in or refuse), and no Python copy of the whole file is held."""

    def __init__(self, table: Any) -> None:
        self.table = table

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return json.loads(self.table[i]["row"])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, (list, TextFileRows)) and list(self) == list(other)


def _read_text_file(path: Path, split: str | None) -> Sequence[dict[str, Any]]:
    """A JSONL, JSON or CSV file read once (every row checked, with its line) into ``datasets``' cache, which later
    runs read without reading the file again while it is unchanged; without ``datasets`` installed, a list."""
    try:
        import datasets
    except ImportError:  # without rlcore[data]: the rows as a list, read the same way
        return list(_TEXT_READERS[path.suffix.lower()](path, split))  # type: ignore[return-value]
    datasets = _datasets(path)
    from rlcore.datasets.caches import datasets_cache_dir

    st = path.stat()
    kwargs = {
        "path": str(path.absolute()),
        "reader": path.suffix.lower(),
        "split": split,
        "stamp": (st.st_size, st.st_mtime_ns),
    }
    try:
        table = datasets.Dataset.from_generator(_row_texts, gen_kwargs=kwargs, cache_dir=datasets_cache_dir())
    except datasets.exceptions.DatasetGenerationError as exc:
        if isinstance(exc.__cause__, DataError):
            raise exc.__cause__ from None
        if next(_row_texts(**kwargs), None) is None:  # datasets refuses an empty table
            raise DataError(f"{path}{f' (split {split})' if split else ''}: no rows") from None
        raise DataError(f"{path}: not readable ({' '.join(str(exc.__cause__ or exc).split())[:300]})") from None
    return TextFileRows(table)


def _datasets(path: Path) -> Any:
    try:
        import datasets
    except ImportError:
        raise DataError(f"{path}: reading it needs Hugging Face datasets: pip install 'rlcore[data]'") from None
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def _read_parquet(path: Path) -> Any:
    """A memory-mapped ``datasets.Dataset`` (rows are read as drawn, never copied into Python at once)."""
    datasets = _datasets(path)
    try:
        return datasets.load_dataset("parquet", data_files=str(path), split="train")
    except Exception as exc:  # noqa: BLE001 - pyarrow's and datasets' many error types, reported as one line
        raise DataError(f"{path}: not a readable parquet file ({' '.join(str(exc).split())})") from None


def _read_datasets_dir(path: Path, split: str | None) -> Any:
    """A ``save_to_disk`` directory (a DatasetDict or one Dataset), with ``datasets.load_from_disk``."""
    if not (path / "dataset_dict.json").is_file() and not (path / "state.json").is_file():
        raise DataError(
            f"{path}: a directory, but not one written by datasets' save_to_disk (no state.json or "
            "dataset_dict.json); give the data file itself"
        )
    datasets = _datasets(path)
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:  # noqa: BLE001
        raise DataError(f"{path}: not readable by datasets.load_from_disk ({' '.join(str(exc).split())})") from None
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded)
        if split is None:
            if len(splits) != 1:
                raise DataError(f"{path}: holds the splits {', '.join(splits)}: pick one with split")
            split = splits[0]
        if split not in splits:
            raise DataError(f"{path}: no split '{split}' (it has {', '.join(splits)})")
        return loaded[split]
    if split is not None:
        raise DataError(f"{path}: split '{split}' given, but the directory holds one split")
    return loaded


_TEXT_READERS = {".jsonl": _jsonl_rows, ".json": _json_rows, ".csv": _csv_rows}
