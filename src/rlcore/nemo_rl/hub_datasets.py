"""NeMo-RL's GRPO / distillation dataset names (``data.dataset_name``, ``data.train.dataset_name``) as the hub
datasets they load, with the rows' keys and the validation set each comes with.

Read from NeMo-RL's dataset classes (``nemo_rl/data/datasets/response_datasets``): the hub id and split each
loads, the columns it reads the prompt and the answer from, and its validation set (a second hub dataset, or a
seeded share of the training rows). A converted config reads the same rows through ``data.<split>.hub_id``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class HubDataset:
    """One NeMo-RL dataset name: the hub dataset it loads and how its rows are read."""

    hub_id: str
    split: str = "train"
    subset: str | None = None
    #: ``data.input_key`` / ``output_key`` / ``messages_key`` of its rows
    keys: dict[str, str] = field(default_factory=dict)
    #: the validation set it comes with: another hub dataset ``(hub id, split)``, or None
    validation: tuple[str, str] | None = None
    #: the share of the training rows held out as validation (NeMo-RL's test_size), or 0
    held_out: float = 0.0


_AIME_H4 = ("HuggingFaceH4/aime_2024", "train")
_AIME_DAPO = ("BytedTsinghua-SIA/AIME-2024", "train")
_DAPO_KEYS = {"messages_key": "prompt", "output_key": "reward_model.ground_truth"}

#: NeMo-RL's dataset names, by name.
NAMES: dict[str, HubDataset] = {
    "OpenMathInstruct-2": HubDataset("nvidia/OpenMathInstruct-2", "train_1M",
                                     keys={"input_key": "problem", "output_key": "expected_answer"}, held_out=0.05),
    "DeepScaler": HubDataset("agentica-org/DeepScaleR-Preview-Dataset",
                             keys={"input_key": "problem", "output_key": "answer"}, validation=_AIME_H4),
    "AIME2024": HubDataset(*_AIME_H4, keys={"input_key": "problem", "output_key": "answer"}),
    # the row's prompt is a message log already; the answer is nested
    "DAPOMath17K": HubDataset("BytedTsinghua-SIA/DAPO-Math-17k", keys=_DAPO_KEYS, validation=_AIME_DAPO),
    "DAPOMathAIME2024": HubDataset(*_AIME_DAPO, keys=_DAPO_KEYS),
}


def describe(name: str) -> str:
    """What ``name`` maps to, in one cell of docs/nemo-rl-mapping.md."""
    d = NAMES[name]
    parts = [f"`{d.hub_id}` split `{d.split}`" + (f" subset `{d.subset}`" if d.subset else "")]
    parts.append(", ".join(f"{k} `{v}`" for k, v in d.keys.items()))
    if d.validation:
        parts.append(f"validation `{d.validation[0]}` split `{d.validation[1]}`")
    elif d.held_out:
        parts.append(f"validation: {d.held_out:g} of the rows (data.split_validation_size)")
    return "; ".join(parts)
