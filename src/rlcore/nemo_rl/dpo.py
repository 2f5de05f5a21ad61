"""NeMo-RL's DPO configs as rlcore's: a ``dpo`` section without a ``grpo`` one is a DPO run.

NeMo-RL's DPO (``examples/run_dpo.py``) reads ``dpo``, ``policy``, ``data``, ``checkpointing``, ``logger``
and ``cluster``. The GRPO sections it does not read (``loss_fn``, ``env``, ``policy.generation``) are
dropped before the table is walked and listed as ignored, since rlcore refuses them in a DPO config. The
``dpo`` keys map by the table (same names, the loss options included); absent ones take NeMo-RL's defaults.
NeMo-RL tokenizes a pair with BOS and EOS and without a generation prompt whatever ``data.add_*`` say (its
preference preprocessor passes none of them), so ``dpo.add_bos`` / ``add_eos`` / ``add_generation_prompt``
are set to that. The ``data`` section is read key by key, its files as SFT's
(:class:`~rlcore.nemo_rl.data_reader.DataReader`: ``data.train`` / ``data.validation`` entries with
``data_path``, or the early releases' ``train_data_path`` / ``val_data_path``), with NeMo-RL's
``data.val_data_paths`` (one entry) in place of the validation set, as NeMo-RL does. Its rows:

- PreferenceDataset's (a ``context`` message log and ranked ``completions``; HelpSteer3 and Tulu3Preference,
  which NeMo-RL downloads, are formatted to these) → ``data.messages_key: context``;
- BinaryPreferenceDataset's (``prompt_key`` text, ``chosen`` and ``rejected`` responses) → ``data.input_key``;
  rlcore reads the responses from the ``chosen`` and ``rejected`` columns, so other ``chosen_key`` /
  ``rejected_key`` values are refused.

``checkpointing.metric_name`` ``val:validation-<set>_<metric>`` (NeMo-RL's name for the validation set's
metric) becomes ``validation/<metric>``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlcore.config.messages import show_value
from rlcore.nemo_rl.conversion import Conversion, algorithm, get, nemo_defaults, put, without_unread
from rlcore.nemo_rl.data_reader import TOP_LEVEL as DATA_TOP_LEVEL
from rlcore.nemo_rl.data_reader import DataReader, Items, value_of
from rlcore.nemo_rl.hub_datasets import PREFERENCE_NAMES

#: NeMo-RL's defaults of ``dpo`` keys (its DPOConfig, main) where rlcore's differ.
NEMO_DEFAULTS = {"val_period": 25, "val_batches": 8, "val_at_start": True, "seed": 42}
#: How NeMo-RL's DPO tokenizes a pair (get_formatted_message_log's defaults), as rlcore's dpo settings.
TOKENIZATION = {"add_bos": True, "add_eos": True, "add_generation_prompt": False}
#: The sections of a NeMo-RL config its DPO does not read, with why.
UNREAD = {
    "loss_fn": "NeMo-RL's DPO trains its own loss (set in dpo); it does not read the policy-gradient loss",
    "env": "NeMo-RL's DPO scores nothing; it does not read the environments",
    "policy.generation": "NeMo-RL's DPO generates nothing; it does not read the generation settings",
}
#: NeMo-RL's DPO validation metrics (DPOValMetrics) that rlcore's DPO validation computes.
METRICS = ("loss", "accuracy", "preference_loss", "sft_loss", "rewards_chosen_mean", "rewards_rejected_mean")
#: Datasets whose rows are (or are formatted by NeMo-RL to) a 'context' log with ranked 'completions'.
RANKED = ("PreferenceDataset", "HelpSteer3", "Tulu3Preference")
BINARY = "BinaryPreferenceDataset"
#: BinaryPreferenceDataset's column keys and NeMo-RL's defaults (rlcore reads 'chosen' and 'rejected').
BINARY_KEYS = {"prompt_key": "prompt", "chosen_key": "chosen", "rejected_key": "rejected"}
TOKENS = ("add_bos", "add_eos", "add_generation_prompt")
#: Dataset keys that change nothing an rlcore DPO run computes, with why.
IGNORED = {
    "num_workers": "dataloader worker processes: rlcore reads the data once, before the run",
    "processor": "NeMo-RL's DPO tokenizes every row with its preference preprocessor, as rlcore's DPO does",
    "system_prompt_file": "NeMo-RL's DPO tokenizes the rows' own messages and never adds it",
    "env_name": "a DPO run scores nothing",
    "use_multiple_dataloader": "one dataloader",
    "task_name": "one task per run",
}
NULL_ONLY = {"subset": ("Hugging Face dataset subsets", "set it to null and give the rows as a local file (data_path)")}
#: Where each split's file and split name are, in the flat layout of the early releases.
FLAT_KEYS = {"train": (("train_data_path",), ("train_split",)), "validation": (("val_data_path",), ("val_split",))}


class _PreferenceData(DataReader):
    """A DPO config's ``data`` (see the module's docstring)."""

    FLAT_KEYS = FLAT_KEYS
    TOP_LEVEL = {*DATA_TOP_LEVEL, *TOKENS, "val_data_paths"}
    IGNORED = IGNORED
    NULL_ONLY = NULL_ONLY
    HUB_NAMES = PREFERENCE_NAMES
    ENTRY_NAMES = {
        "dataset_name",
        "data_path",
        "split",
        "prompt_file",
        *BINARY_KEYS,
        *IGNORED,
        *NULL_ONLY,
        *(k for keys in FLAT_KEYS.values() for group in keys for k in group),
    }
    ROWS = (
        "NeMo-RL's PreferenceDataset rows: a 'context' message log and ranked 'completions'; for 'prompt', "
        "'chosen' and 'rejected' rows also set its dataset_name=BinaryPreferenceDataset"
    )

    def __init__(self, nemo: dict[str, Any], out: Conversion) -> None:
        super().__init__(nemo, out)
        self.kinds: dict[str, tuple[Any, str]] = {}  # split → (dataset_name, where it is set)

    def top_level(self, key: str, value: Any) -> None:
        if key in TOKENS:
            self.ignore(
                f"data.{key}",
                "NeMo-RL's DPO does not read it: it tokenizes with BOS and EOS, without a "
                "generation prompt (dpo.add_bos, add_eos, add_generation_prompt)",
            )
        elif key != "val_data_paths":  # read with the splits
            super().top_level(key, value)

    def splits(self, data: dict[str, Any]) -> dict[str, Items]:
        splits = super().splits(data)
        flat = self.is_flat(data)  # the flat section's dataset_name and keys serve both splits
        for name, items in splits.items():
            if name == "train" or not flat:
                where = "data" if flat else f"data.{name}"
                self.kinds[name] = items.get("dataset_name", (None, f"{where}.dataset_name"))
        paths = data.get("val_data_paths")
        if not isinstance(paths, dict) or not paths:
            if "val_data_paths" in data:
                self.ignore("data.val_data_paths", "empty: none")
            return splits
        if len(paths) > 1:
            self.problem(
                "data.val_data_paths",
                f"names {len(paths)} validation sets; an rlcore run validates on one file: keep one",
            )
            return splits
        ((name, path),) = paths.items()
        replaced = (k for k in data if k == "validation" or (k.startswith("val_") and k != "val_data_paths"))
        for key in replaced:
            self.ignore(f"data.{key}", "data.val_data_paths replaces it, as in NeMo-RL")
        key = self.FLAT_KEYS["validation"][0][0] if flat else "data_path"
        splits["validation"] = {key: (path, f"data.val_data_paths.{name}")}
        self.kinds["validation"] = ("PreferenceDataset", f"data.val_data_paths.{name}")  # NeMo-RL reads it so
        return splits

    def named_file(self, name_path: str, name: str) -> None:
        """The dataset's name says how its rows read: :meth:`row_keys` reports it."""

    def row_keys(self, splits: dict[str, Items]) -> None:
        """Each split's rows by its dataset (``self.kinds``): ranked ones read their 'context', binary ones their
        ``prompt_key``; rlcore has one ``data.input_key`` and one ``data.messages_key`` for both splits."""
        ranked, prompts, binary = [], {}, []
        for name, (kind, path) in self.kinds.items():
            items = splits.get(name, {})
            if kind in RANKED:
                ranked.append(path)
                for key in BINARY_KEYS:
                    if key in items:
                        self.ignore(items[key][1], f"only {BINARY} reads it; {path} is {show_value(kind)}")
            elif kind == BINARY:
                prompts[name] = self.binary(items, path)
                binary.append(path)
            elif kind is None:
                self.problem(
                    path, f"is missing; NeMo-RL's DPO needs one: PreferenceDataset or {BINARY} (with a local data_path)"
                )
            else:
                self.problem(
                    path,
                    f"is {show_value(kind)}, a dataset rlcore does not read: give the rows as a local "
                    "file with dataset_name PreferenceDataset ('context' and ranked 'completions') or "
                    f"{BINARY} ('prompt', 'chosen' and 'rejected')",
                )
        if ranked:
            self.set("data.messages_key", "context", ", ".join(sorted(set(ranked))))
        if len({key for key, _ in prompts.values()}) > 1:
            self.problem(
                prompts["validation"][1],
                f"data.train's is {show_value(prompts['train'][0])}, "
                f"data.validation's {show_value(prompts['validation'][0])}; rlcore reads both splits with "
                "one data.input_key: give them the same (e.g. in data.default)",
            )
        elif prompts:
            self.set(
                "data.input_key",
                next(iter(prompts.values()))[0],
                ", ".join(sorted({path for _, path in prompts.values()} | set(binary))),
            )
        self.prompt_file(splits)

    def binary(self, items: Items, path: str) -> tuple[str, str]:
        """A BinaryPreferenceDataset split's prompt key and where it is set; its response keys must be rlcore's."""
        for key in ("chosen_key", "rejected_key"):
            value = value_of(items, key, BINARY_KEYS[key])
            if key not in items:
                continue
            if value == BINARY_KEYS[key]:
                self.ignore(items[key][1], f"rlcore reads the '{value}' column")
            else:
                self.problem(
                    items[key][1],
                    f"is {show_value(value)}, but rlcore reads a binary row's responses from "
                    f"its 'chosen' and 'rejected' columns: rename the column in the file and set it to "
                    f"{show_value(BINARY_KEYS[key])}",
                )
        return value_of(items, "prompt_key", BINARY_KEYS["prompt_key"]), items.get("prompt_key", (None, path))[1]

    def prompt_file(self, splits: dict[str, Items]) -> None:
        """NeMo-RL formats a split's first user message with its prompt file; rlcore formats the input_key rows
        (binary splits) with one ``data.prompt_file``, and no message-log rows."""
        values = {name: value_of(items, "prompt_file") for name, items in splits.items()}
        paths = sorted({items["prompt_file"][1] for items in splits.values() if "prompt_file" in items})
        if all(value is None for value in values.values()):
            for path in paths:
                self.ignore(path, "null: none")
            return
        for name, value in values.items():
            kind, where = self.kinds.get(name, (None, ""))
            if value is not None and kind in RANKED:
                self.problem(
                    splits[name]["prompt_file"][1],
                    f"is set, but {where} names message-log rows "
                    "('context'), and rlcore formats only input_key rows with the prompt file: set it to null",
                )
                return
        files = {value for name, value in values.items() if self.kinds.get(name, (None,))[0] == BINARY}
        if len(files) > 1:
            self.problem(
                paths[-1],
                "differs between data.train and data.validation; rlcore formats both splits with "
                "one data.prompt_file: give them the same (e.g. in data.default)",
            )
        elif files - {None}:
            self.set("data.prompt_file", str(Path(str(files.pop())).expanduser().absolute()), ", ".join(paths))


def without_unread_sections(nemo: dict[str, Any], out: Conversion) -> dict[str, Any]:
    """``nemo`` without the GRPO sections NeMo-RL's DPO does not read, each listed as ignored."""
    return without_unread(nemo, out, UNREAD)


def validation_metrics(nemo: dict[str, Any]) -> dict[str, str]:
    """NeMo-RL's ``checkpointing.metric_name`` values of a DPO config, by rlcore metric: ``val:validation-<set>_<m>``,
    the set being 'default' (data.validation) or the name under data.val_data_paths."""
    paths = get(nemo, "data.val_data_paths")
    names = list(paths) if isinstance(paths, dict) and paths else ["default"]
    return {f"val:validation-{name}_{metric}": f"validation/{metric}" for name in names for metric in METRICS}


def dpo_data(nemo: dict[str, Any], out: Conversion) -> None:
    """A DPO config's ``data`` (see the module's docstring)."""
    data = nemo.get("data")
    if algorithm(nemo) == "dpo" and isinstance(data, dict):
        _PreferenceData(nemo, out).read(data)


def dpo_defaults(nemo: dict[str, Any], out: Conversion) -> None:
    """A DPO config's absent ``dpo`` keys (NeMo-RL's defaults where they differ from rlcore's) and NeMo-RL's
    tokenization of pairs."""
    if algorithm(nemo) != "dpo":
        return
    nemo_defaults(nemo, out, "dpo", NEMO_DEFAULTS)
    for key, value in TOKENIZATION.items():
        put(out.config, f"dpo.{key}", value)
        out.sources[f"dpo.{key}"] = "dpo (NeMo-RL's DPO tokenizes with BOS and EOS, without a generation prompt)"


__all__ = ["dpo_data", "dpo_defaults", "validation_metrics", "without_unread_sections"]
