"""The ``data`` section of NeMo-RL's offline algorithms (SFT, DPO), read key by key into rlcore's ``data``.

Both read one train and one validation dataset from files: the flat section of the early releases (each
algorithm names its file keys, e.g. ``train_data_path``), or ``data.train`` / ``data.validation`` entries
(v0.6 on) with ``data.default`` filling in their keys. An entry naming a dataset NeMo-RL loads by name, without
a ``data_path``, reads that hub dataset (``HUB_NAMES``); another name gets a line saying which override gives a
local file. What the
rows hold (their keys) is each algorithm's (:class:`DataReader` subclasses in :mod:`rlcore.nemo_rl.sft` and
:mod:`rlcore.nemo_rl.dpo`); every key is reported once, by its NeMo-RL path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlcore.config.messages import show_value
from rlcore.nemo_rl.conversion import Conversion, is_neutral, put, unknown_problem
from rlcore.nemo_rl.hub_datasets import AUDIO_NAMES, audio_refusal
from rlcore.nemo_rl.table import UNKNOWN_NEUTRAL

#: A split's items: each key of its entry (``data.default``'s filled in) as (value, NeMo-RL path).
Items = dict[str, tuple[Any, str]]
#: Where the entries of the v0.6 layout keep their file and split name.
ENTRY_KEYS = (("data_path",), ("split",))
#: The files that hold one split (a .json may map split names to rows; a directory may hold several).
ONE_SPLIT_SUFFIXES = (".jsonl", ".csv", ".parquet")
#: Keys of ``data`` itself (not of a dataset) that every offline algorithm has.
TOP_LEVEL = {"max_input_seq_length", "shuffle", "train", "validation", "default"}


class DataReader:
    """One reading of an offline config's ``data``; subclasses say which keys their algorithm has."""

    #: The early releases' flat section: per split, (its file keys, its split-name keys).
    FLAT_KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}
    #: Keys of ``data`` itself.
    TOP_LEVEL: set[str] = TOP_LEVEL
    #: Dataset keys that change nothing the algorithm computes, with why.
    IGNORED: dict[str, str] = {}
    #: Dataset keys that change nothing while null: (what rlcore lacks, the fix).
    NULL_ONLY: dict[str, tuple[str, str]] = {}
    #: Every key a dataset may have: one of these left at the top level of the v0.6 layout is misplaced.
    ENTRY_NAMES: set[str] = set()
    #: What a row of a local file holds, for the line asking for one.
    ROWS = ""
    #: The dataset names NeMo-RL loads from the hub for this algorithm (rlcore.nemo_rl.hub_datasets).
    HUB_NAMES: dict[str, Any] = {}

    def __init__(self, nemo: dict[str, Any], out: Conversion) -> None:
        self.nemo, self.out = nemo, out
        self.done: set[str] = set()

    def first(self, path: str) -> bool:
        """Whether ``path`` is reported for the first time (a ``data.default`` key reaches both splits)."""
        if path in self.done:
            return False
        self.done.add(path)
        return True

    def set(self, target: str, value: Any, source: str) -> None:
        put(self.out.config, target, value)
        self.out.sources[target] = source
        self.done.update(source.split(", "))

    def ignore(self, path: str, why: str) -> None:
        if self.first(path):
            self.out.ignored.append((path, why))

    def problem(self, path: str, line: str) -> None:
        if self.first(path):
            self.out.problems.append(f"{path}: {line}")

    # -- the section ------------------------------------------------------------------------------

    def read(self, data: dict[str, Any]) -> None:
        flat = self.is_flat(data)
        for key, value in data.items():
            if key in self.TOP_LEVEL:
                self.top_level(key, value)
        splits = self.splits(data)
        if "train" not in splits:
            self.problem("data.train", "no training rows: give them as ++data.train.data_path=/path/to/train.jsonl")
        for name, items in splits.items():
            self.dataset(name, items, *((self.FLAT_KEYS[name], "data") if flat else (ENTRY_KEYS, f"data.{name}")))
        self.named_validation(splits, flat)
        self.row_keys({"train": splits["train"]} if flat else splits)  # the flat section has one set of keys
        for name, items in splits.items():
            for key, (value, path) in items.items():
                self.entry_key(name, key, value, path)

    def is_flat(self, data: dict[str, Any]) -> bool:
        return "train" not in data and "default" not in data

    def splits(self, data: dict[str, Any]) -> dict[str, Items]:
        return self.flat_splits(data) if self.is_flat(data) else self.entry_splits(data)

    def top_level(self, key: str, value: Any) -> None:
        path = f"data.{key}"
        if key == "shuffle":
            self.set("data.shuffle", value, path)
        elif key == "max_input_seq_length":
            self.max_input(value)
        elif value is None:  # data.validation: null, data.default: null
            self.ignore(path, "null: none")

    def max_input(self, value: Any) -> None:
        """NeMo-RL masks a sample this long out of the loss (cut to a few tokens): rlcore's same-named key."""
        if value is None:
            self.ignore("data.max_input_seq_length", "null: no limit but policy.max_total_sequence_length")
        else:
            self.set("data.max_input_seq_length", value, "data.max_input_seq_length")

    def flat_splits(self, data: dict[str, Any]) -> dict[str, Items]:
        """The early releases' one section: its validation keys apart, the rest the train split's."""
        val_keys = {k for keys in self.FLAT_KEYS["validation"] for k in keys}
        items = {k: (v, f"data.{k}") for k, v in data.items() if k not in self.TOP_LEVEL}
        train = {k: item for k, item in items.items() if k not in val_keys}
        validation = {k: item for k, item in items.items() if k in val_keys}
        return {"train": train, **({"validation": validation} if validation else {})}

    def entry_splits(self, data: dict[str, Any]) -> dict[str, Items]:
        """Each entry's keys, ``data.default``'s filled in; dataset keys left at the top level are refused."""
        default = data.get("default") if isinstance(data.get("default"), dict) else {}
        for key, value in data.items():
            path = f"data.{key}"
            if key in self.TOP_LEVEL:
                continue
            if key in self.IGNORED:
                self.ignore(path, self.IGNORED[key])
            elif is_neutral(value, UNKNOWN_NEUTRAL):
                self.ignore(path, "null: changes nothing")
            elif key in self.ENTRY_NAMES:
                self.problem(
                    path,
                    f"is {show_value(value)}, but NeMo-RL (since v0.6) reads a dataset's keys from "
                    "data.train / data.validation (data_path, ...): move it there",
                )
            elif self.first(path):
                self.out.problems.append(unknown_problem(path, value))
        splits = {}
        for name in ("train", "validation"):
            entry = data.get(name)
            if isinstance(entry, list):
                self.problem(
                    f"data.{name}",
                    f"is a list of {len(entry)} datasets; an rlcore run reads one file per split: give one entry",
                )
            elif isinstance(entry, dict):
                splits[name] = {
                    **{k: (v, f"data.default.{k}") for k, v in default.items()},
                    **{k: (v, f"data.{name}.{k}") for k, v in entry.items()},
                }
        return splits

    # -- one split ----------------------------------------------------------------------------------

    def dataset(self, name: str, items: Items, keys: tuple[tuple[str, ...], tuple[str, ...]], where: str) -> None:
        """The split's file (a local path, or a problem naming the override that gives one) and its split;
        ``keys``: the names of both, ``where``: the section that holds them."""
        path_keys, split_keys = keys
        found = next((items[k] for k in path_keys if value_of(items, k) is not None), None)
        dataset_name, name_path = items.get("dataset_name", (None, None))
        override = f"{where}.{path_keys[0]}"
        file = None
        if found is not None:
            file = Path(str(found[0])).expanduser().absolute()
            self.set(f"data.{name}.path", str(file), found[1])
            if name_path is not None:
                self.named_file(name_path, name)
        elif name_path is not None and str(dataset_name) in self.HUB_NAMES:
            given = next((items[k] for k in split_keys if value_of(items, k) is not None), (None, name_path))
            if (problem := self.HUB_NAMES[str(dataset_name)].split_problem(given[0])) is not None:
                self.problem(given[1], problem)
                return
            for key, value in self.HUB_NAMES[str(dataset_name)].entry(given[0]).items():
                self.set(f"data.{name}.{key}", value, given[1] if key == "split" else name_path)
            for key in (k for k in split_keys if k in items and items[k][0] is None):
                self.ignore(items[key][1], "null: the hub dataset's own split")
        elif name_path is not None and str(dataset_name) in AUDIO_NAMES:
            self.problem(name_path, audio_refusal(dataset_name))
        elif name_path is not None:
            self.problem(
                name_path,
                f"is {show_value(dataset_name)}, a dataset rlcore does not know by name "
                "(docs/nemo-rl-mapping.md lists those it does); give its rows as a local file: "
                f"++{override}=/path/to/{name}.jsonl ({self.ROWS})",
            )
        elif name == "train":
            self.problem("data.train", f"no training rows: give them as ++{override}=/path/to/train.jsonl")
        for key in (k for k in split_keys if k in items):
            split, split_path = items[key]
            if split is None:
                self.ignore(split_path, "null: the whole file")
            elif file is None:
                self.ignore(split_path, "no local file for this split")
            elif file.suffix in ONE_SPLIT_SUFFIXES:
                self.ignore(
                    split_path,
                    f"a {file.suffix} file holds one split; NeMo-RL's split picks one of a dataset loaded by name",
                )
            else:
                self.set(f"data.{name}.split", split, split_path)

    def named_validation(self, splits: dict[str, Items], flat: bool) -> None:
        """The validation set a hub dataset's name comes with, when the config gives none: the flat layout's (v0.4)
        validation split, or the share of the rows NeMo-RL's class holds out by default."""
        items = splits.get("train", {})
        hub = self.HUB_NAMES.get(str(value_of(items, "dataset_name")))
        if hub is None or "validation" in splits or any(value_of(items, k) for k in ("data_path", "train_data_path")):
            return
        source = items["dataset_name"][1]
        if flat and hub.validation_entry():
            for key, value in hub.validation_entry().items():
                self.set(f"data.validation.{key}", value, source)
        elif hub.held_out and "split_validation_size" not in items:
            self.set("data.split_validation_size", hub.held_out, source)

    def named_file(self, name_path: str, name: str) -> None:
        """A split with a local file and a ``dataset_name`` (at ``name_path``): the file has the rows."""
        self.ignore(name_path, f"the rows are the local file data.{name}.path")

    def entry_key(self, name: str, key: str, value: Any, path: str) -> None:
        """A key of a split's entry that :meth:`dataset` and :meth:`row_keys` did not read."""
        if path in self.done:
            return
        if key in self.IGNORED:
            self.ignore(path, self.IGNORED[key])
        elif key in self.NULL_ONLY:
            what, fix = self.NULL_ONLY[key]
            if value is None:
                self.ignore(path, f"null: {what} is not supported by rlcore")
            else:
                self.problem(path, f"is {show_value(value)}, but rlcore does not support {what}: {fix}")
        elif is_neutral(value, UNKNOWN_NEUTRAL):
            self.ignore(path, "not known to rlcore's NeMo-RL reader; its value changes nothing")
        elif self.first(path):
            self.out.problems.append(unknown_problem(path, value))

    def row_keys(self, splits: dict[str, Items]) -> None:
        """The keys of the rows (``data.input_key`` ...): the algorithm's."""


def value_of(items: Items, key: str, default: Any = None) -> Any:
    """A key's value in a split's entry; ``default`` when absent or null."""
    value = items[key][0] if key in items else None
    return default if value is None else value


__all__ = ["DataReader", "ENTRY_KEYS", "Items", "value_of"]
