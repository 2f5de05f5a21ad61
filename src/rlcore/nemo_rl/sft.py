"""NeMo-RL's SFT configs as rlcore's: an ``sft`` section without a ``grpo`` one is an SFT run.

NeMo-RL's SFT reads ``sft``, ``policy``, ``data``, ``checkpointing``, ``logger`` and ``cluster``. The
GRPO sections it does not read (``loss_fn``, ``env``, ``policy.generation``) are dropped before the table
is walked and listed as ignored, since rlcore refuses them in an SFT config. The ``sft`` keys map by the
table (same names); the ``data`` section is read key by key, its files by
:class:`~rlcore.nemo_rl.data_reader.DataReader` (shared with DPO) and its rows here (a GRPO config's is
:mod:`rlcore.nemo_rl.tasks`'s):

- the files: ``data.train`` / ``data.validation`` entries with ``data_path`` (v0.6 on, ``data.default``
  filling in their keys), or the flat section of the early releases (``train_data_path`` or ``data_path``,
  ``val_data_path``); a dataset NeMo-RL downloads by name needs a local copy;
- the rows: NeMo-RL's ResponseDataset (``input_key`` prompt, ``output_key`` answer) and OpenAI-format
  datasets (a ``chat_key`` message log), which rlcore's data layer reads the same way
  (``data.input_key`` / ``output_key`` / ``messages_key``), one set of keys for both splits;
- ``add_bos`` / ``add_eos`` / ``add_generation_prompt`` → ``sft.*``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlcore.config.messages import show_value
from rlcore.nemo_rl.conversion import Conversion, is_sft, nemo_defaults, without_unread
from rlcore.nemo_rl.data_reader import TOP_LEVEL as DATA_TOP_LEVEL
from rlcore.nemo_rl.data_reader import DataReader, Items, value_of
from rlcore.nemo_rl.hub_datasets import SFT_NAMES

#: NeMo-RL's defaults of ``sft`` keys (its SFTConfig, main) where rlcore's differ: an sft section without the
#: key means these. (The releases before required every key.)
NEMO_DEFAULTS = {"val_period": 10, "val_batches": 8, "val_at_start": True, "seed": 42}
#: The sections of a NeMo-RL config its SFT does not read, with why.
UNREAD = {
    "loss_fn": "NeMo-RL's SFT trains NLL; it does not read the policy-gradient loss",
    "env": "NeMo-RL's SFT scores nothing; it does not read the environments",
    "policy.generation": "NeMo-RL's SFT generates nothing; it does not read the generation settings",
}
TOKENS = ("add_bos", "add_eos", "add_generation_prompt")
#: NeMo-RL's row keys (one per dataset entry), rlcore's single one for both splits, and their default.
ROW_KEYS = {
    "input_key": ("input_key", "input"),
    "output_key": ("output_key", "output"),
    "chat_key": ("messages_key", "messages"),
    "prompt_file": ("prompt_file", None),
    "system_prompt": ("system_prompt", None),
}
#: Dataset keys that change nothing an rlcore SFT run computes, with why.
IGNORED = {
    "num_workers": "dataloader worker processes: rlcore reads the data once, before the run",
    "use_multiple_dataloader": "one dataloader",
    "task_name": "one task per run",
    "seed": "rlcore holds data.split_validation_size out with sft.seed",
    "use_preserving_dataset": "rlcore keeps each row as written (no columns filled in from other rows)",
    "system_prompt_file": "NeMo-RL's SFT tokenizes the rows' own messages and never adds it",
    "env_name": "an SFT run scores nothing",
}
#: Dataset keys that change nothing while null; another value is an error: (what rlcore lacks, the fix).
NULL_ONLY = {
    "system_key": (
        "a system message from a column of the row",
        "set it to null and put the system message in the row's messages (or use system_prompt)",
    ),
    "tool_key": (
        "tool definitions for the chat template (rlcore's SFT renders messages only)",
        "set it to null, with rows that hold no tools",
    ),
    "subset": ("Hugging Face dataset subsets", "set it to null and give the rows as a local file (data_path)"),
}
#: Where each split's file and split name are, in the flat layout of the early releases.
FLAT_KEYS = {
    "train": (("train_data_path", "data_path"), ("split", "train_split")),
    "validation": (("val_data_path",), ("val_split",)),
}


class _Data(DataReader):
    """An SFT config's ``data``: ResponseDataset and OpenAI-format rows, NeMo-RL's add_* tokens."""

    FLAT_KEYS = FLAT_KEYS
    TOP_LEVEL = {*DATA_TOP_LEVEL, *TOKENS}
    IGNORED = IGNORED
    NULL_ONLY = NULL_ONLY
    ENTRY_NAMES = {
        "dataset_name",
        "data_path",
        "split",
        "split_validation_size",
        "processor",
        *ROW_KEYS,
        *IGNORED,
        *NULL_ONLY,
        *(k for keys in FLAT_KEYS.values() for group in keys for k in group),
    }
    ROWS = "each a 'messages' log, or 'input' and 'output'"
    HUB_NAMES = SFT_NAMES

    def top_level(self, key: str, value: Any) -> None:
        if key in TOKENS:
            self.set(f"sft.{key}", value, f"data.{key}")
        else:
            super().top_level(key, value)

    def entry_key(self, name: str, key: str, value: Any, path: str) -> None:
        if path in self.done:
            return
        if key == "processor":
            if value in (None, "sft_processor"):
                self.ignore(path, "rlcore's SFT tokenizes each row as NeMo-RL's sft_processor does")
            else:
                self.problem(
                    path,
                    f"is {show_value(value)}, but rlcore's SFT tokenizes each row as NeMo-RL's "
                    "sft_processor does: set it to sft_processor",
                )
        elif key == "split_validation_size":
            if name == "train" and value:
                self.set("data.split_validation_size", value, path)
            elif value:
                self.problem(
                    path,
                    f"is {show_value(value)}, but rlcore holds validation rows out of data.train only: remove it here",
                )
            else:
                self.ignore(path, "none held out")
        else:
            super().entry_key(name, key, value, path)

    # -- what both splits share ---------------------------------------------------------------------------

    def row_keys(self, splits: dict[str, Items]) -> None:
        """``input_key``, ``output_key``, ``chat_key``, ``prompt_file``, ``system_prompt``: one value in rlcore,
        so the validation entry's must be the train entry's (null is NeMo-RL's default)."""
        for key, (target, nemo_default) in ROW_KEYS.items():
            values = {name: _row_key(items, key, target, nemo_default) for name, items in splits.items()}
            given = {name: items[key][1] for name, items in splits.items() if key in items}
            if len(set(map(repr, values.values()))) > 1:
                where = given.get("validation") or given.get("train") or "data.validation.dataset_name"
                self.problem(
                    where,
                    f"data.train's is {show_value(values['train'])}, data.validation's "
                    f"{show_value(values['validation'])}; rlcore reads both splits with one data.{target}: "
                    "give them the same (e.g. in data.default)",
                )
                continue
            value = values.get("train", nemo_default)
            named = sorted({path for name, path in given.items() if value_of(splits[name], key) is not None})
            if named or value != nemo_default:
                if key == "prompt_file" and value is not None:
                    value = str(Path(str(value)).expanduser().absolute())
                self.set(f"data.{target}", value, ", ".join(named) or "data.train.dataset_name (its columns)")
            for path in sorted(set(given.values()) - set(named)):
                self.ignore(
                    path,
                    "null: none"
                    if nemo_default is None
                    else f"null: NeMo-RL's default {show_value(nemo_default)}, rlcore's too",
                )
        self.prompt_with_logs(splits)
        self.image_column(splits)

    def image_column(self, splits: dict[str, Items]) -> None:
        """An image dataset's image column (CLEVR's ``image``), which NeMo-RL's sft_processor puts before the
        question in the user's message: rlcore's ``data.image_key``."""
        items = splits.get("train", {})
        named = SFT_NAMES.get(str(value_of(items, "dataset_name")))
        if named is not None and "image_key" in named.keys and not value_of(items, "data_path"):
            self.set("data.image_key", named.keys["image_key"], items["dataset_name"][1])

    def prompt_with_logs(self, splits: dict[str, Items]) -> None:
        """rlcore formats an input_key row with data.prompt_file; NeMo-RL also formats a message log's first user
        message, which rlcore does not: refused for OpenAI-format datasets, whose rows are message logs."""
        source = self.out.sources.get("data.prompt_file")
        if source is None or self.out.config.get("data", {}).get("prompt_file") is None:
            return
        for items in splits.values():
            if value_of(items, "dataset_name") == "openai_format":
                self.out.problems.append(
                    f"{source.split(', ')[0]}: is set, but {items['dataset_name'][1]} is 'openai_format' (message "
                    "logs), and rlcore formats only input_key rows with the prompt file: set it to null"
                )
                return


def _row_key(items: Items, key: str, target: str, nemo_default: Any) -> Any:
    """A row key's value for one split: as given, else the named dataset's column, else NeMo-RL's default."""
    named = SFT_NAMES.get(str(value_of(items, "dataset_name")))
    columns = named.keys if named is not None else {}
    return value_of(items, key, columns.get(target, nemo_default))


def without_unread_sections(nemo: dict[str, Any], out: Conversion) -> dict[str, Any]:
    """``nemo`` without the GRPO sections NeMo-RL's SFT does not read, each listed as ignored."""
    return without_unread(nemo, out, UNREAD)


def sft_data(nemo: dict[str, Any], out: Conversion) -> None:
    """An SFT config's ``data`` (see the module's docstring)."""
    data = nemo.get("data")
    if is_sft(nemo) and isinstance(data, dict):
        _Data(nemo, out).read(data)


def sft_defaults(nemo: dict[str, Any], out: Conversion) -> None:
    """An SFT config's ``sft`` keys that are absent: NeMo-RL's defaults where they differ from rlcore's."""
    if is_sft(nemo):
        nemo_defaults(nemo, out, "sft", NEMO_DEFAULTS)


__all__ = ["sft_data", "sft_defaults", "without_unread_sections"]
