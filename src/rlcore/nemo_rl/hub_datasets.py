"""NeMo-RL's dataset names (``data.dataset_name``, ``data.train.dataset_name``) as the hub datasets they load, with
the rows' keys, the row format and the validation set each comes with, per algorithm family.

Read from NeMo-RL's dataset classes (``nemo_rl/data/datasets/response_datasets`` and ``preference_datasets`` at
main 7ea279a, and v0.4.0's for the flat layout's names): the hub id, subset and split each loads, the columns it
reads (or the rewrite of its rows, :mod:`rlcore.datasets.formats`), and its validation set (a split or another hub
dataset, or a seeded share of the training rows). A converted config reads the same rows through
``data.<split>.hub_id`` / ``split`` / ``subset`` / ``format``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class HubDataset:
    """One NeMo-RL dataset name: the hub dataset it loads and how its rows are read."""

    hub_id: str
    split: str = "train"
    subset: str | None = None
    #: ``data.input_key`` / ``output_key`` / ``messages_key`` of its rows (after the format)
    keys: dict[str, str] = field(default_factory=dict)
    #: the validation set it comes with: ``(hub id, split)`` (the same hub id: its subset and format too), or None
    validation: tuple[str, str] | None = None
    #: the share of the training rows held out as validation (NeMo-RL's split_validation_size), or 0
    held_out: float = 0.0
    #: ``data.<split>.format``: how its rows are rewritten (rlcore.datasets.formats), or None
    format: str | None = None
    #: NeMo-RL's split names when it checks them (empty: any split of the hub dataset)
    splits: tuple[str, ...] = ()
    #: a split NeMo-RL reads from a hub dataset of its own (as that one's 'train' split), by split name
    split_repos: dict[str, str] = field(default_factory=dict)

    def split_problem(self, split: str | None) -> str | None:
        """Why NeMo-RL would refuse ``split`` for this dataset (None: it reads it)."""
        names = tuple(self.split_repos) or self.splits
        if split is None or not names or split in names:
            return None
        return f"is {split!r}, a split NeMo-RL does not read for this dataset: use one of {', '.join(names)}"

    def entry(self, split: str | None = None) -> dict[str, Any]:
        """``data.<split>``'s hub settings for this dataset (``split``: the config's, else the dataset's own)."""
        split = split or self.split
        out: dict[str, Any] = {"hub_id": self.hub_id, "split": split}
        if split in self.split_repos:  # a repository per split, each read as its 'train'
            out = {"hub_id": self.split_repos[split], "split": "train"}
        elif self.subset:
            out["subset"] = self.subset
        if self.format:
            out["format"] = self.format
        return out

    def validation_entry(self) -> dict[str, Any] | None:
        """``data.validation``'s hub settings of the validation set the name comes with (None: none or held out)."""
        if self.validation is None:
            return None
        hub_id, split = self.validation
        return self.entry(split) if hub_id == self.hub_id else {"hub_id": hub_id, "split": split}


_AIME_H4 = ("HuggingFaceH4/aime_2024", "train")
_AIME_DAPO = ("BytedTsinghua-SIA/AIME-2024", "train")
_DAPO_KEYS = {"messages_key": "prompt", "output_key": "reward_model.ground_truth"}
_OMI2 = HubDataset(
    "nvidia/OpenMathInstruct-2",
    "train_1M",
    keys={"input_key": "problem", "output_key": "expected_answer"},
    held_out=0.05,
)
_GSM8K = HubDataset(
    "openai/gsm8k", subset="main", keys={"input_key": "question", "output_key": "answer"}, format="gsm8k"
)

_CLEVR = "MMInstruction/Clevr_CoGenT_"
#: NeMo-RL's image datasets (read by its VLM scripts; ``clevr.py``, ``geometry3k.py``): the image column, the
#: question (``data.input_key``, formatted by the prompt file) and the answer, each row rewritten as NeMo-RL's
#: loader rewrites it (rlcore.datasets.formats: CLEVR's answer is the text of ``solution``'s ``<answer>`` tags;
#: geometry3k's problem loses its ``<image>`` marker and shows its first image only).
VLM_NAMES: dict[str, HubDataset] = {
    "clevr-cogent": HubDataset(
        f"{_CLEVR}TrainA_70K_Complex",
        keys={"input_key": "problem", "output_key": "solution", "image_key": "image"},
        split_repos={"train": f"{_CLEVR}TrainA_70K_Complex", "valA": f"{_CLEVR}ValA", "valB": f"{_CLEVR}ValB"},
        format="clevr_cogent",
    ),
    "geometry3k": HubDataset(
        "hiyouga/geometry3k",
        keys={"input_key": "problem", "output_key": "answer", "image_key": "images"},
        splits=("train", "validation", "test"),
        format="geometry3k",
    ),
}

#: NeMo-RL's audio(-visual) datasets (its Qwen2.5-Omni recipes): refused by name, saying what is missing.
AUDIO_NAMES = frozenset({"avqa", "daily-omni", "audiomcq", "mmau"})


def audio_refusal(name: object) -> str:
    """Why an audio dataset name is refused (after its dotted path)."""
    return (
        f"is {name!r}, one of NeMo-RL's audio datasets: rlcore trains on text and images (docs/vision.md), "
        "and has no audio or video inputs (no audio tower, no sound or frame processor in its batches); "
        "use a text or image dataset instead"
    )


#: GRPO's and distillation's names (response datasets scored by the math environment; the image datasets by the
#: vlm environment).
NAMES: dict[str, HubDataset] = {
    "OpenMathInstruct-2": _OMI2,
    "DeepScaler": HubDataset(
        "agentica-org/DeepScaleR-Preview-Dataset",
        keys={"input_key": "problem", "output_key": "answer"},
        validation=_AIME_H4,
    ),
    "AIME2024": HubDataset(*_AIME_H4, keys={"input_key": "problem", "output_key": "answer"}),
    # the row's prompt is a message log already; the answer is nested
    "DAPOMath17K": HubDataset("BytedTsinghua-SIA/DAPO-Math-17k", keys=_DAPO_KEYS, validation=_AIME_DAPO),
    "DAPOMathAIME2024": HubDataset(*_AIME_DAPO, keys=_DAPO_KEYS),
    "gsm8k": _GSM8K,
    "GSM8K": _GSM8K,
    **VLM_NAMES,
}

#: SFT's names (message logs, or input/output rows).
SFT_NAMES: dict[str, HubDataset] = {
    "squad": HubDataset(
        "rajpurkar/squad",
        keys={"messages_key": "messages"},
        format="squad",
        validation=("rajpurkar/squad", "validation"),
    ),
    "OpenMathInstruct-2": _OMI2,
    "openmathinstruct2": _OMI2,  # v0.4's SFT name
    "open_assistant": HubDataset(
        "OpenAssistant/oasst1", keys={"messages_key": "messages"}, format="oasst", held_out=0.05
    ),
    "tulu3_sft_mixture": HubDataset("allenai/tulu-3-sft-mixture", keys={"messages_key": "messages"}, held_out=0.05),
    "gsm8k": _GSM8K,
    "GSM8K": _GSM8K,
    # NeMo-RL's sft_processor formats CLEVR's rows (its other image datasets' it does not read)
    "clevr-cogent": VLM_NAMES["clevr-cogent"],
}

#: DPO's and RM's names (a 'context' log and ranked 'completions').
PREFERENCE_NAMES: dict[str, HubDataset] = {
    "HelpSteer3": HubDataset(
        "nvidia/HelpSteer3",
        subset="preference",
        keys={"messages_key": "context"},
        format="helpsteer3",
        validation=("nvidia/HelpSteer3", "validation"),
    ),
    "Tulu3Preference": HubDataset(
        "allenai/llama-3.1-tulu-3-8b-preference-mixture", keys={"messages_key": "context"}, format="tulu3_preference"
    ),
}

#: Each family's names, as docs/nemo-rl-mapping.md lists them.
FAMILIES = {"GRPO, distillation": NAMES, "SFT": SFT_NAMES, "DPO, RM": PREFERENCE_NAMES}


def describe(name: str, names: dict[str, HubDataset] = NAMES) -> str:
    """What ``name`` maps to, in one cell of docs/nemo-rl-mapping.md."""
    d = names[name]
    if d.split_repos:
        parts = ["; ".join(f"split `{split}`: `{hub_id}`" for split, hub_id in d.split_repos.items())]
    else:
        parts = [f"`{d.hub_id}` split `{d.split}`" + (f" subset `{d.subset}`" if d.subset else "")]
    if d.splits:
        parts[0] += f" (splits {', '.join(f'`{s}`' for s in d.splits)})"
    if d.format:
        parts.append(f"format `{d.format}`")
    parts.append(", ".join(f"{k} `{v}`" for k, v in d.keys.items()))
    if d.validation:
        parts.append(f"validation `{d.validation[0]}` split `{d.validation[1]}`")
    elif d.held_out:
        parts.append(f"validation: {d.held_out:g} of the rows (data.split_validation_size)")
    return "; ".join(parts)
