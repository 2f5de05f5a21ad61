"""Sections of a run's task: ``data`` (where the samples come from) and ``env`` (what scores them).

A sample is a message log (a system prompt, the user's prompt) plus its
row's columns as metadata, with the expected answer under ``ground_truth``;
the environment named by ``env.name`` (a plugin of kind ``environment``)
scores each completion against it. See ``docs/tasks.md``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, NonNegativeInt, PositiveFloat, PositiveInt, model_validator

from rlcore.config.base import SectionsModel, StrictModel

#: The toy task of the default run: generated prompts asking for digits.
DIGITS_GENERATOR = "rlcore.environments.digits:digit_prompts"


#: The row formats of rlcore.datasets.formats (and oasst's trees).
RowFormat = Literal["squad", "gsm8k", "helpsteer3", "tulu3_preference", "oasst", "clevr_cogent", "geometry3k"]


class DatasetConfig(StrictModel):
    """One split's samples: a local file or directory, a Hugging Face hub dataset, or a generator function (exactly
    one). Files, directories and hub datasets are all read with Hugging Face ``datasets`` (docs/datasets.md)."""

    path: str | None = Field(
        None,
        description="A local .jsonl, .json, .parquet or .csv file, or a directory written by Hugging Face "
        "datasets' save_to_disk.",
    )
    hub_id: str | None = Field(
        None,
        description="A Hugging Face hub dataset ('org/name'), loaded with datasets.load_dataset and its "
        "cache; offline (HF_HUB_OFFLINE=1), the copy 'hf download --repo-type dataset <id>' put in the hub cache.",
    )
    split: str | None = Field(
        None,
        description="The split: of a hub dataset (default 'train'), of a datasets directory holding several, "
        "or the key of a .json file whose top level maps split names to rows.",
    )
    subset: str | None = Field(None, description="A hub dataset's subset (its config name), e.g. 'main' for gsm8k.")
    revision: str | None = Field(None, description="A hub dataset's git revision (branch, tag or commit).")
    data_files: str | list[str] | dict[str, str | list[str]] | None = Field(
        None, description="Which files of a hub dataset to read (datasets.load_dataset's data_files)."
    )
    format: RowFormat | None = Field(
        None,
        description="Rewrite each row as NeMo-RL's dataset class of that name does (a hub dataset's own "
        "columns into messages, or context and ranked completions), when the row is drawn; docs/datasets.md.",
    )
    generator: str | None = Field(
        None,
        description="'module:function' called as fn(step, n, seed, **generator_kwargs) -> list of prompts "
        "(strings) or rows (dicts): samples made up per step, without epochs.",
    )
    generator_kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the generator.")

    @property
    def source(self) -> str | None:
        """What the rows come from, for messages: the path or the hub id."""
        return self.path or self.hub_id

    @model_validator(mode="after")
    def _one_source(self) -> DatasetConfig:
        if sum(value is not None for value in (self.path, self.hub_id, self.generator)) != 1:
            raise ValueError(
                "give exactly one of path (a local file or directory), hub_id (a hub dataset, "
                "'org/name') and generator ('module:function')"
            )
        if self.generator is not None and self.split is not None:
            raise ValueError("split: only a file or directory has splits; a generator makes its samples")
        if self.generator is not None and self.format is not None:
            raise ValueError("format: rewrites a dataset's rows; a generator makes its samples: drop format")
        if self.hub_id is None:
            for key in ("subset", "revision", "data_files"):
                if getattr(self, key) is not None:
                    raise ValueError(f"{key}: belongs to a hub dataset: set hub_id too, or drop {key}")
        return self


class DataConfig(StrictModel):
    """The run's samples: a train split, an optional validation split, and how a row becomes a prompt.

    A row holding ``messages_key`` (a list of ``{role, content}``) is a message log as it is; any other row's
    ``input_key`` is the user's prompt, formatted by ``prompt_template`` / ``prompt_file`` and preceded by the
    system prompt. ``output_key`` is the expected answer the environment sees as ``ground_truth``.
    """

    train: DatasetConfig = Field(
        default_factory=lambda: DatasetConfig(generator=DIGITS_GENERATOR),
        description="The training samples (default: the toy digits prompts).",
    )
    validation: DatasetConfig | None = Field(
        None, description="The validation samples (grpo.val_*); none = no validation."
    )
    input_key: str = Field(
        "input",
        description="The column holding the prompt. Each key may name a field inside "
        "nested columns with dots (reward_model.ground_truth) when no column has that name.",
    )
    output_key: str = Field(
        "output",
        description="The column holding the expected answer (the environment's "
        "ground_truth); a row without it has none.",
    )
    messages_key: str = Field("messages", description="The column holding a whole message log, used as it is.")
    image_key: str | None = Field(
        None,
        description="The column holding a row's images (a list, or one image: a datasets Image value, PNG/JPEG "
        "bytes, a path, relative to the data file's directory, or a data:image URL), for vision-language models. "
        "They fill the messages' {'type': 'image'} parts in order, or, with none, go before the text of the first "
        "user message. NeMo-RL's CLEVR rows call it 'image', Geometry3K's 'images'. None = no image column (image "
        "parts may still carry their own 'image').",
    )
    system_prompt: str | None = Field(None, description="A system message before every prompt.")
    system_prompt_file: str | None = Field(None, description="A file holding the system prompt.")
    prompt_template: str | None = Field(
        None,
        description="The user message, with '{}' (or '{input}') where the row's input goes; none = the input "
        "as it is. Other columns may be named too: '{question} ({unit})'.",
    )
    prompt_file: str | None = Field(None, description="A file holding the prompt template (NeMo-RL's prompt_file).")
    shuffle: bool = Field(True, description="Shuffle the training samples each epoch (seeded by grpo.seed).")
    split_validation_size: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Hold out this fraction of the train file as validation samples (a seeded "
        "draw, the same every run; NeMo-RL's name); 0 = none. Only without data.validation.",
    )
    max_input_seq_length: PositiveInt | None = Field(
        None,
        description="NeMo-RL's: a sample this long is cut to a few tokens and masked out of the loss "
        "(sample_mask 0), counted per step. GRPO and distillation: a prompt of at least this many tokens (it is "
        "still generated from and scored; cut_prompts); SFT: a sample of at least this many; DPO: a pair with a "
        "sequence longer than this (cut_samples / cut_pairs). At most policy.max_total_sequence_length; "
        "none = only what exceeds policy.max_total_sequence_length (a prompt that leaves no completion room is "
        "an error).",
    )

    @model_validator(mode="after")
    def _one_of_each(self) -> DataConfig:
        for text, file in (("system_prompt", "system_prompt_file"), ("prompt_template", "prompt_file")):
            if getattr(self, text) is not None and getattr(self, file) is not None:
                raise ValueError(f"{text} and {file}: give one of them")
        if self.validation is not None and self.validation.generator is not None:
            raise ValueError("validation: validation needs fixed samples: give a path or hub_id, not a generator")
        if self.split_validation_size and (self.validation is not None or self.train.generator is not None):
            raise ValueError(
                "split_validation_size: holds out part of data.train.path as the validation samples; "
                "it needs a train file and no data.validation"
            )
        return self


class EnvConfig(SectionsModel):
    """The environment that scores completions: a plugin of kind ``environment``, and where it runs.

    Its own settings are the sibling section ``<name>_cfg`` (``env.math_cfg``), validated by the plugin.
    """

    name: str = Field(
        "digits",
        description="The environment (rlcore backends list --kind environment): digits, "
        "math, exact_match, regex, python, or a plugin's.",
    )
    num_workers: NonNegativeInt = Field(
        0,
        description="Ray actors running the environment beside the loop, the batch split among them; 0 = in "
        "the driver.",
    )
    timeout_s: PositiveFloat = Field(
        60.0,
        description="How long one actor's share of a batch (num_workers > 0), or the whole batch in the "
        "driver (0), may take; its samples then get reward 0 (counted in env/errors) and the "
        "actor, or the driver's environment object, is replaced. In the driver the late call is "
        "interrupted, or left running on a thread of its own (docs/tasks.md). For an agent environment: how "
        "long one episode may take; a late one is cancelled and its sample fails (docs/agents.md).",
    )
    on_nonfinite_reward: Literal["zero", "fail"] = Field(
        "zero",
        description="A reward (or reward component) that is NaN or +-inf: 'zero' makes the sample an "
        "environment failure (reward 0, counted in env/errors and env/nonfinite_rewards); 'fail' stops the run in "
        "one line naming the sample and the environment.",
    )
    max_failure_fraction: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="The share of one batch's samples that may fail in the environment "
        "(raise, time out, non-finite reward: reward 0, counted in env/errors); more stops the run in one line "
        "naming the first error, where it was raised and logs/environment_errors.log. A batch in which every "
        "sample failed always stops it; 0 = any failure does.",
    )


#: NeMo-RL's cut of a sample at ``data.max_input_seq_length``: each message keeps at most this many tokens.
CUT_MESSAGE_TOKENS = 4


def cut_tokens_per_message(max_input: int, messages: int) -> int:
    """The tokens each of a cut sample's ``messages`` keeps: NeMo-RL's ``min(4, max_seq_length // messages)``."""
    return min(CUT_MESSAGE_TOKENS, max_input // max(messages, 1))


def max_input_problem(cfg: Any) -> str | None:
    """Why ``data.max_input_seq_length`` does not fit ``policy.max_total_sequence_length`` (None when it does):
    a limit above it would let a prompt in that leaves no room for a completion, and a cut prompt must leave
    room for one too."""
    limit, total = cfg.data.max_input_seq_length, cfg.policy.max_total_sequence_length
    if limit is None:
        return None
    if limit > total:
        return (
            f"data.max_input_seq_length: is {limit}, above policy.max_total_sequence_length ({total}): a sample is "
            f"masked from this length on, so it must be at most {total}; lower it (or leave it null)"
        )
    if min(CUT_MESSAGE_TOKENS, limit) >= total:
        return (
            f"data.max_input_seq_length: is {limit}, and a prompt cut at it keeps {min(CUT_MESSAGE_TOKENS, limit)} "
            f"tokens, which leaves no room for a completion within policy.max_total_sequence_length ({total}); "
            "raise policy.max_total_sequence_length"
        )
    return None


__all__ = [
    "CUT_MESSAGE_TOKENS",
    "DIGITS_GENERATOR",
    "DataConfig",
    "DatasetConfig",
    "EnvConfig",
    "cut_tokens_per_message",
    "legacy_task_sections",
    "max_input_problem",
]


# -- rlcore 0.1's task section ---------------------------------------------------------------------------------

_TOY = {"prompts": "rlcore.run.tasks.toy:digit_prompts", "reward": "rlcore.run.tasks.toy:digit_reward"}


def legacy_task_sections(task: Any, given: list[str]) -> dict[str, Any]:
    """rlcore 0.1's ``task: {prompts, reward, kwargs}`` as the ``data`` and ``env`` sections that do the same.

    The prompts function becomes the train split's generator, the reward function the ``python``
    environment's; the toy task's functions become the default digits task. ``given``: the new sections the
    config also has (an error: one way to say it).
    """
    import warnings

    if given:
        raise ValueError(
            f"task: replaced by data and env, which this config also sets ({', '.join(given)}): "
            "move the task into them (docs/tasks.md)"
        )
    if not isinstance(task, dict) or set(task) - {"prompts", "reward", "kwargs"}:
        raise ValueError("task: expected prompts, reward and kwargs (rlcore 0.1's task section; now data and env)")
    warnings.warn(
        "task: the task section is now data.train.generator and env (docs/tasks.md); it goes in rlcore 0.3",
        DeprecationWarning,
        stacklevel=2,
    )
    moved = "rlcore.algorithms.toy_task:"  # the toy's path until rlcore 0.1
    prompts, reward = (task.get(key, _TOY[key]).replace(moved, "rlcore.run.tasks.toy:") for key in _TOY)
    kwargs = task.get("kwargs") or {}
    if prompts == _TOY["prompts"] and reward == _TOY["reward"] and not kwargs:
        return {}
    if prompts == _TOY["prompts"]:
        prompts = DIGITS_GENERATOR
    return {
        "data": {"train": {"generator": prompts, "generator_kwargs": kwargs}},
        "env": {"name": "python", "python_cfg": {"reward": reward, "kwargs": kwargs}},
    }
