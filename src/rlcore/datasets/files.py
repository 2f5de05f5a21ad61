"""Rows from local files: JSONL, JSON, CSV, parquet, and directories written by Hugging Face ``datasets``.

Every problem is one :class:`DataError` line naming the file, the row (1-based: the line of a JSONL file) and
the field, so a bad row is found before anything starts. Parquet files and ``save_to_disk`` directories are read
with Hugging Face ``datasets``, as memory-mapped Arrow: a row becomes a Python dict only when it is drawn. JSONL,
JSON and CSV are read here, row by row, so an error names the line.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any, Sequence


class DataError(ValueError):
    """A dataset problem, in one line naming the file, the row and the field, and the fix."""


def read_rows(path: str | Path, split: str | None = None) -> Sequence[dict[str, Any]]:
    """The rows of a local dataset file or ``datasets`` directory; ``split`` picks one of several."""
    path = Path(path).expanduser()
    if not path.exists():
        raise DataError(f"{path}: no such file or directory")
    if path.is_dir():
        rows = _read_datasets_dir(path, split)
    else:
        reader = _READERS.get(path.suffix.lower())
        if reader is None:
            raise DataError(f"{path}: unknown format '{path.suffix}'; use .jsonl, .json, .parquet, .csv or a "
                            "directory written by datasets' save_to_disk")
        if split is not None and reader is not _read_json:
            raise DataError(f"{path}: split '{split}' given, but a {path.suffix} file holds one split")
        rows = reader(path, split) if reader is _read_json else reader(path)
    if len(rows) == 0:
        raise DataError(f"{path}{f' (split {split})' if split else ''}: no rows")
    return rows


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[:exc.start].count(b"\n") + 1
        raise DataError(f"{path}: line {line}: not UTF-8 (byte {exc.start}); re-encode the file as UTF-8") from None


def _row(path: Path, number: int, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise DataError(f"{path}: row {number}: expected an object (key: value), got {type(value).__name__}")
    return value


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    # A JSONL line ends at '\n' only: str.splitlines would also cut at U+2028 or U+0085, which a JSON string may
    # hold unescaped. A '\r' before the '\n' is JSON whitespace.
    for number, line in enumerate(_text(path).split("\n"), 1):
        if not line.strip():
            continue
        try:
            rows.append(_row(path, number, json.loads(line)))
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}: row {number}: not JSON ({exc.msg} at column {exc.colno})") from None
    return rows


def _read_json(path: Path, split: str | None) -> list[dict[str, Any]]:
    try:
        data = json.loads(_text(path))
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
    return [_row(path, number, row) for number, row in enumerate(data, 1)]


def _read_csv(path: Path) -> list[dict[str, Any]]:
    import io

    return [dict(row) for row in csv.DictReader(io.StringIO(_text(path), newline=""))]


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
        raise DataError(f"{path}: a directory, but not one written by datasets' save_to_disk (no state.json or "
                        "dataset_dict.json); give the data file itself")
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


_READERS = {".jsonl": _read_jsonl, ".json": _read_json, ".csv": _read_csv, ".parquet": _read_parquet}
