"""NeMo-RL's ``data`` and ``env`` sections as rlcore's: the dataset files, their keys, prompts, and the environment.

Two layouts are read: the flat one of the early releases (``data.dataset_name``,
``data.prompt_file`` ...) and the one of v0.5 on (``data.train`` /
``data.validation`` / ``data.default``, each dataset's keys falling back to
``default``). rlcore reads local files only: a dataset NeMo-RL downloads by
name gets one line saying which local file to give (``data.train.data_path``),
and its known column names are used for that file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlcore.config.messages import show_value
from rlcore.nemo_rl import vlm
from rlcore.nemo_rl.conversion import Conversion, algorithm, put, same
from rlcore.nemo_rl.dpo import validation_metrics as dpo_metrics
from rlcore.nemo_rl.hub_datasets import AUDIO_NAMES, NAMES, HubDataset, audio_refusal
from rlcore.plugins.unknown_names import what_to_do_about

#: NeMo-RL datasets it downloads by name, and the keys of their rows (``data.*_key``).
HUB_DATASETS: dict[str, dict[str, str]] = {name: dict(d.keys) for name, d in NAMES.items()}
#: Environments NeMo-RL names in ``env_name`` that rlcore has, by rlcore name.
ENVIRONMENTS = {"math": "math"}
#: NeMo-RL environments whose section is the task itself: their run script makes the prompts and scores them, and
#: reads none of ``data``. Without an installed environment of that name such a recipe would train another task
#: (the inherited math data), so the section refuses the run instead of being ignored.
TASK_ENVIRONMENTS = {
    "sliding_puzzle_game": "NeMo-RL's sliding-puzzle game (its script, examples/run_grpo_sliding_puzzle.py, "
    "generates the puzzles and scores each move over up to grpo.max_rollout_turns turns; data.* is not read)",
}
#: NeMo-RL environments rlcore cannot run here, with what they need.
UNRUNNABLE_ENVIRONMENTS = {
    "nemo_gym": "NeMo-Gym, which needs Python >= 3.12 (this rlcore runs on 3.11); its agents speak OpenAI's API, "
    "so on a Python that has it they can drive rollouts through rlcore's endpoint as an agent environment "
    "(env.name: agent with a function that calls them; docs/agents.md)",
}
#: Keys of NeMo-RL's math environment section it declares but does not read (nemo_rl/environments/math_environment.py).
MATH_ENV_UNREAD = {
    "stop_strings": "declared by NeMo-RL's MathEnvConfig but read nowhere: generation stops at "
    "policy.generation.stop_strings",
}
#: Keys that change nothing here, with why.
IGNORED = {
    "num_workers": "dataloader worker processes: rlcore reads the data once, before the run",
    "seed": "rlcore splits and shuffles with grpo.seed (NeMo-RL's draw cannot be repeated by another sampler "
    "either way)",
    "task_name": "one task per run",
    "dataset_name": "the dataset is data.train.path",
    "split": "the file is the split",
}
#: The keys of a GRPO (or distillation) ``data`` section, or of one of its entries, that this module reads.
READ = {
    "train",
    "validation",
    "default",
    "data_path",
    "train_data_path",
    "val_data_path",
    "dataset_name",
    "split",
    "input_key",
    "output_key",
    "messages_key",
    "prompt_file",
    "system_prompt_file",
    "env_name",
    "split_validation_size",
    "shuffle",
    "repeat",
    "processor",
    "max_input_seq_length",
    "use_multiple_dataloader",
}
#: Keys NeMo-RL reads only with ``data.use_multiple_dataloader: true`` (which is refused).
MULTIPLE_DATALOADER_KEYS = ("num_prompts_per_dataloader", "custom_dataloader")
#: Keys of SFT's data that NeMo-RL's GRPO and distillation scripts do not read.
SFT_ONLY = ("add_bos", "add_eos", "add_generation_prompt")
#: NeMo-RL's data processors that build a prompt the way rlcore does: the prompt file formatted with the row's
#: input_key, after the system prompt, through the chat template; the row's output_key is the ground truth
#: (nemo_rl/data/processors.py, math_hf_data_processor; 'default' is that one).
PROMPT_PROCESSORS = (None, "default", "math_hf_data_processor")


def _set(out: Conversion, target: str, value: Any, source: str) -> None:
    put(out.config, target, value)
    out.sources[target] = source


def _file(out: Conversion, target: str, value: Any, source: str) -> None:
    """A file setting: NeMo-RL reads relative paths from the working directory; written absolute, so the
    converted config means the same file wherever it is saved."""
    _set(out, target, str(Path(str(value)).expanduser().absolute()), source)


def _merged(data: dict[str, Any], name: str) -> tuple[dict[str, Any] | None, str]:
    """A dataset entry with ``data.default``'s keys filled in (new layout), or the flat section (old layout)."""
    if "train" not in data and "default" not in data:
        return (data if name == "train" else None), "data"
    entry = data.get(name)
    if not isinstance(entry, dict):
        return None, f"data.{name}"
    return {**(data.get("default") or {}), **entry}, f"data.{name}"


def _dataset(entry: dict[str, Any], where: str, split: str, out: Conversion) -> HubDataset | None:
    """The path and keys of one dataset entry (``split``: 'train' or 'validation'); the hub dataset its name
    maps to, if it names one."""
    path = entry.get("data_path") or entry.get(f"{split}_data_path") or entry.get(f"{split[:3]}_data_path")
    name = entry.get("dataset_name")
    columns = HUB_DATASETS.get(str(name))
    if not path and str(name) in NAMES:
        if (problem := NAMES[str(name)].split_problem(entry.get("split"))) is not None:
            out.problems.append(f"{where}.split: {problem}")
            return None
        _hub_dataset(NAMES[str(name)], where, split, out, entry.get("split"))
        return NAMES[str(name)]
    if not path and str(name) in AUDIO_NAMES:
        out.problems.append(f"{where}.dataset_name: {audio_refusal(name)}")
        return None
    if not path:
        out.problems.append(
            f"{where}.dataset_name: is {show_value(name)}, a dataset rlcore does not know by name "
            f"(docs/nemo-rl-mapping.md lists those it does); give its rows as a local file: "
            f"++{where}.data_path=/path/to/{split}.jsonl"
        )
        return
    _file(out, f"data.{split}.path", path, f"{where}.data_path")
    if entry.get("split"):
        _set(out, f"data.{split}.split", entry["split"], f"{where}.split")
    if split == "train":
        for key in ("input_key", "output_key", "messages_key"):
            value = entry.get(key, (columns or {}).get(key))
            if value is not None:
                _set(out, f"data.{key}", value, f"{where}.{key}")
    return None


def _hub_dataset(d: HubDataset, where: str, split: str, out: Conversion, given_split: Any = None) -> None:
    """A dataset name NeMo-RL loads from the hub: its hub id, split (``given_split``: the entry's), subset, row
    format and (train) row keys."""
    source = f"{where}.dataset_name"
    for key, value in d.entry(given_split).items():
        _set(out, f"data.{split}.{key}", value, f"{where}.split" if key == "split" and given_split else source)
    if split == "train":
        for key, value in d.keys.items():
            _set(out, f"data.{key}", value, source)


def _named_validation(d: HubDataset, out: Conversion) -> None:
    """The validation set a dataset name of the flat layout (v0.4) comes with in NeMo-RL."""
    if d.validation is not None:
        for key, value in (d.validation_entry() or {}).items():
            _set(out, f"data.validation.{key}", value, "data.dataset_name")
    elif d.held_out:
        _set(out, "data.split_validation_size", d.held_out, "data.dataset_name")


def _prompts(
    entry: dict[str, Any], where: str, out: Conversion, own: dict[str, Any] | None = None, images: bool = False
) -> None:
    """The prompt files and environment of ``entry``; ``own``: the split's keys as written, so that a key
    ``data.default`` filled in is named as the user wrote it (``data.default.prompt_file``); ``images``: a VLM run
    (:mod:`rlcore.nemo_rl.vlm`), whose processor adds no system prompt and whose environment is ``vlm``."""
    for key in ("prompt_file", "system_prompt_file"):
        if key == "system_prompt_file" and images and entry.get(key):
            out.ignored.append((_written(where, key, own), f"{vlm.VLM_PROCESSOR} adds no system prompt"))
        elif entry.get(key):
            _file(out, f"data.{key}", entry[key], _written(where, key, own))
    env = entry.get("env_name")
    if env is None:
        if images:
            vlm.missing_env(where, out)
        return
    known = {**installed_environments(), **ENVIRONMENTS}
    if images:  # NeMo-RL's VLM script builds every environment the data names as its VLM environment
        _set(out, "env.name", vlm.ENVIRONMENT, _written(where, "env_name", own))
    elif env in known:
        _set(out, "env.name", known[env], _written(where, "env_name", own))
    elif env in UNRUNNABLE_ENVIRONMENTS:
        out.problems.append(f"{_written(where, 'env_name', own)}: is {show_value(env)}, {UNRUNNABLE_ENVIRONMENTS[env]}")
    elif (broken := _not_usable(str(env))) is not None:
        out.problems.append(f"{_written(where, 'env_name', own)}: is {show_value(env)}, {broken}")
    else:
        out.problems.append(
            f"{_written(where, 'env_name', own)}: is {show_value(env)}, and no installed environment has that name "
            f"(installed: {', '.join(sorted(known))}); {what_to_do_about('environment', str(env), sorted(known))}"
        )


def _written(where: str, key: str, own: dict[str, Any] | None) -> str:
    """The NeMo-RL path of ``key`` of the split at ``where``: its own, or ``data.default``'s when the split took it
    from there."""
    return f"data.default.{key}" if own is not None and key not in own else f"{where}.{key}"


def _ignored(data: dict[str, Any], out: Conversion, images: bool = False) -> None:
    """Each key of the data section this module does not map: ignored with why when it changes nothing, else
    refused (a key NeMo-RL reads that decides the data or the prompts is never dropped); ``images``: a VLM run."""
    sections = [("data", data)] + [(f"data.{k}", v) for k, v in data.items() if isinstance(v, dict)]
    for where, section in sections:
        for key, why in IGNORED.items():
            if key in ("dataset_name", "split") and _names_hub_dataset(section):
                continue  # mapped to data.<split>.hub_id
            if key in section:
                out.ignored.append((f"{where}.{key}", why))
        if "repeat" in section:
            _repeat(where, section["repeat"], out)
        if "processor" in section:
            (vlm.processor if images else _processor)(where, section["processor"], out)
        if "max_input_seq_length" in section:
            _max_input(where, section["max_input_seq_length"], out)
        for key in sorted(set(section) - READ - set(IGNORED) - {"train", "validation", "default"}):
            _other_key(where, key, section[key], data, out)
    if data.get("use_multiple_dataloader"):
        out.problems.append(
            "data.use_multiple_dataloader: is true: NeMo-RL then draws each step's prompts from every train dataset's "
            "own dataloader (data.num_prompts_per_dataloader each, or data.custom_dataloader's mix); rlcore reads "
            "one train file: set it to false and give one ++data.train.data_path"
        )
    elif "use_multiple_dataloader" in data:
        out.ignored.append(("data.use_multiple_dataloader", "false: one dataloader, as rlcore's"))


def _other_key(where: str, key: str, value: Any, data: dict[str, Any], out: Conversion) -> None:
    path = f"{where}.{key}"
    if key in MULTIPLE_DATALOADER_KEYS and not data.get("use_multiple_dataloader"):
        out.ignored.append((path, "only read with data.use_multiple_dataloader: true"))
    elif key in SFT_ONLY:
        out.ignored.append((path, "NeMo-RL's SFT reads it; its GRPO and distillation scripts do not"))
    elif value is None or value in ({}, []) or value is False:
        out.ignored.append((path, "not known to rlcore's NeMo-RL reader; its value changes nothing"))
    else:
        out.problems.append(
            f"{path}: is {show_value(value)}, a key of NeMo-RL's data section rlcore does not read; it may decide "
            "which rows, or which text of them, NeMo-RL trains on, so it is not dropped: remove it, or give the "
            "rows as a local file (data_path) with input_key / output_key naming their columns"
        )


def _processor(where: str, value: Any, out: Conversion) -> None:
    """NeMo-RL's data processor makes the prompts: the math one is what rlcore does, another makes another task."""
    if value in PROMPT_PROCESSORS:
        out.ignored.append(
            (
                f"{where}.processor",
                "rlcore builds prompts as math_hf_data_processor does: data.prompt_file formatted with the row's "
                "input_key, after data.system_prompt_file, through the chat template",
            )
        )
        return
    out.problems.append(
        f"{where}.processor: is {show_value(value)}, a NeMo-RL data processor that builds prompts (and their "
        "ground truth) other than rlcore's, which builds them as math_hf_data_processor does; set it to "
        "math_hf_data_processor (with input_key / output_key naming the row's columns) or use a plugin "
        "environment for this task"
    )


def _max_input(where: str, value: Any, out: Conversion) -> None:
    """NeMo-RL cuts a prompt of ``max_input_seq_length`` tokens or more to a few tokens and masks it out of the
    loss: rlcore's ``data.max_input_seq_length`` is that rule, one value for every split."""
    path = f"{where}.max_input_seq_length"
    if value is None:
        out.ignored.append((path, "null: no limit but policy.max_total_sequence_length"))
        return
    earlier = out.config.get("data", {}).get("max_input_seq_length")
    if earlier is not None and not same(earlier, value):
        out.problems.append(
            f"{path}: is {show_value(value)}, but {out.sources['data.max_input_seq_length']} is "
            f"{show_value(earlier)}: rlcore has one limit for every split (data.max_input_seq_length); give one value"
        )
        return
    _set(out, "data.max_input_seq_length", value, path)


def _several_datasets(data: dict[str, Any], out: Conversion) -> bool:
    """``data.train`` / ``data.validation`` as a list (NeMo-RL concatenates the datasets): rlcore reads one file per
    split, and training on the first alone would be another data mix, so the run is refused."""
    lists = [split for split in ("train", "validation") if isinstance(data.get(split), list)]
    for split in lists:
        names = ", ".join(str((d or {}).get("dataset_name") or (d or {}).get("data_path")) for d in data[split])
        out.problems.append(
            f"data.{split}: is a list of {len(data[split])} datasets ({names}), which NeMo-RL concatenates; rlcore "
            f"reads one file per split: concatenate their rows into one file and give ++data.{split}="
            f"{{data_path: /path/to/{split}.jsonl}}"
        )
    return bool(lists)


def _names_hub_dataset(section: dict[str, Any]) -> bool:
    return str(section.get("dataset_name")) in NAMES and not any(
        section.get(k) for k in ("data_path", "train_data_path", "val_data_path")
    )


def _repeat(where: str, value: Any, out: Conversion) -> None:
    """NeMo-RL's ``repeat`` (e.g. AIME2024's validation set 16 times): once is the file; more changes nothing
    rlcore's greedy validation computes, but repeats training rows (refused)."""
    if value in (None, 1):
        out.ignored.append((f"{where}.repeat", "once: the file as it is"))
    elif where == "data.validation":
        out.ignored.append(
            (
                f"{where}.repeat",
                "rlcore validates greedily, one completion per prompt: a repeated "
                "prompt gets the same completion and score, so validation/accuracy does not change",
            )
        )
    else:
        out.problems.append(
            f"{where}.repeat: is {show_value(value)}, but rlcore reads each training row once per "
            "epoch: set it to 1 (repeat the rows in the file, or raise the epochs)"
        )


def task(nemo: dict[str, Any], out: Conversion) -> None:
    """``data`` → ``data`` (files, keys, prompts, shuffle, validation split) and ``env`` → ``env`` (GRPO and
    distillation); an SFT or DPO config's data is :func:`rlcore.nemo_rl.sft.sft_data`'s or
    :func:`rlcore.nemo_rl.dpo.dpo_data`'s."""
    if algorithm(nemo) in ("sft", "dpo"):
        return
    data = nemo.get("data")
    if isinstance(data, dict):
        if _several_datasets(data, out):
            return
        train, where = _merged(data, "train")
        hub, images = None, vlm.is_vlm_run(nemo)
        if train is not None:
            hub = _dataset(train, where, "train", out)
            _prompts(train, where, out, data.get("train") if "default" in data else None, images)
            if train.get("split_validation_size") and not data.get("validation"):
                _set(
                    out, "data.split_validation_size", train["split_validation_size"], f"{where}.split_validation_size"
                )
        validation, val_where = _merged(data, "validation")
        if validation is not None:
            _dataset(validation, val_where, "validation", out)
        elif data.get("val_data_path"):
            _file(out, "data.validation.path", data["val_data_path"], "data.val_data_path")
        elif hub is not None and where == "data":  # the flat layout's dataset brings its validation set
            _named_validation(hub, out)
        if "shuffle" in data:
            _set(out, "data.shuffle", data["shuffle"], "data.shuffle")
        _ignored(data, out, images)
        if train is None:
            out.problems.append(
                "data.train: the data section names no train dataset, so NeMo-RL's script would not start and "
                "rlcore would train on its default task instead: give one, e.g. ++data.train.data_path=/path/to/"
                "train.jsonl"
            )
    env = nemo.get("env")
    if isinstance(env, dict):
        _environment(env, nemo, out)


#: NeMo-RL's ``checkpointing.metric_name`` values rlcore computes, by rlcore metric: GRPO's (and distillation's,
#: whose validation is GRPO's), and SFT's; DPO's name the validation set (``dpo.validation_metrics``).
METRICS = {"val:accuracy": "validation/accuracy", "val:avg_length": "validation/mean_generation_length"}
SFT_METRICS = {"val:val_loss": "validation/loss"}


def checkpoint_metric(nemo: dict[str, Any], out: Conversion) -> None:
    """``checkpointing.metric_name`` ('val:accuracy'; an SFT run's 'val:val_loss', a DPO run's
    'val:validation-default_loss') as rlcore's metric, with ``higher_is_better``."""
    ck = nemo.get("checkpointing")
    name = ck.get("metric_name") if isinstance(ck, dict) else None
    if name is None:
        return
    algo = algorithm(nemo)
    metrics = SFT_METRICS if algo == "sft" else dpo_metrics(nemo) if algo == "dpo" else METRICS
    if name not in metrics:
        which = {"sft": "SFT ", "dpo": "DPO ", "distillation": "distillation "}.get(algo, "")
        out.problems.append(
            f"checkpointing.metric_name: is {show_value(name)}; rlcore ranks {which}checkpoints by "
            f"{', '.join(metrics)} (or, after converting, any metric of metrics.jsonl), or null keeps "
            "the newest"
        )
        return
    _set(out, "checkpointing.metric_name", metrics[name], "checkpointing.metric_name")
    if "higher_is_better" in ck:
        _set(out, "checkpointing.higher_is_better", ck["higher_is_better"], "checkpointing.higher_is_better")


def _not_usable(name: str) -> str | None:
    """Why the environment ``name``, which a plugin registers, cannot be used (its plugin is broken, disabled,
    ...), in the registry's words; None when no plugin registers it."""
    from rlcore.plugins import BackendError, get_registry

    registry = get_registry()
    try:
        record = registry.find(name, "environment")
    except BackendError:
        return None  # no plugin registers it: the caller's line says what to do
    try:
        registry.resolve(name, "environment")
    except BackendError as exc:
        return f"but {exc}; fix or reinstall {record.distribution} (rlcore environments list shows it)"
    return None


def installed_environments() -> dict[str, str]:
    """The environments installed here (built-in and plugins), each under its own name."""
    from rlcore.plugins import get_registry

    return {r.name: r.name for r in get_registry().environments() if r.status == "ok"}


def _environment(env: dict[str, Any], nemo: dict[str, Any], out: Conversion) -> None:
    """NeMo-RL's ``env.<name>`` sections: the selected environment's settings (the data's ``env_name``, or
    without one the first section rlcore has) become ``env.<name>_cfg``; NeMo-RL's math and reward-model sections
    are translated key by key (:mod:`rlcore.nemo_rl.reward_model`), an installed plugin environment's section is its
    config class's to validate."""
    from rlcore.nemo_rl.reward_model import reward_model_settings

    plugins = installed_environments()
    images = vlm.env_section(nemo)
    for name, settings in env.items():
        if isinstance(settings, dict) and name == images:
            vlm.environment(name, settings, out)
            continue
        if name in TASK_ENVIRONMENTS and name not in plugins:
            out.problems.append(
                f"env.{name}: is {TASK_ENVIRONMENTS[name]}, a task rlcore has no environment for (installed: "
                f"{', '.join(sorted(plugins))}); install a plugin that registers '{name}' to run this recipe, "
                "or remove the section to train the math task its data names"
            )
            continue
        if not isinstance(settings, dict) or (name not in ENVIRONMENTS and name not in plugins):
            out.ignored.append(
                (
                    f"env.{name}",
                    "no installed environment has this name (rlcore environments list), and no data entry's "
                    "env_name names it (that is refused): NeMo-RL creates only the environments the data names "
                    "(v0.4: env.math only)",
                )
            )
            continue
        target = ENVIRONMENTS.get(name, name)
        if "env.name" not in out.sources:
            _set(out, "env.name", target, f"env.{name}")
        if out.config.get("env", {}).get("name") != target:
            out.ignored.append(
                (
                    f"env.{name}",
                    f"the run's environment is {out.config['env']['name']} (from {out.sources['env.name']})",
                )
            )
            continue
        if name == vlm.ENVIRONMENT:  # NeMo-RL's VLM environment, by its registered name
            vlm.environment(name, settings, out)
            continue
        if "num_workers" in settings:
            _set(out, "env.num_workers", settings["num_workers"], f"env.{name}.num_workers")
        if name in ENVIRONMENTS:
            _math_settings(name, settings, out)
        elif name == "reward_model":
            reward_model_settings(settings, nemo, out)
        else:
            for key, value in settings.items():
                if key != "num_workers":
                    _set(out, f"env.{name}_cfg.{key}", value, f"env.{name}.{key}")


def _math_settings(name: str, settings: dict[str, Any], out: Conversion) -> None:
    impl = settings.get("math_verify_impl")
    if impl is not None:
        verifier = {"hf_math_verify": "math_verify", "dapo_math_verify": "dapo"}.get(str(impl))
        if verifier is None:
            out.problems.append(
                f"env.{name}.math_verify_impl: is {show_value(impl)}; rlcore verifies with "
                "'hf_math_verify' (math-verify), 'dapo_math_verify' (DAPO's grader) or its own rules "
                "(env.math_cfg.verifier: builtin)"
            )
        else:
            _set(out, "env.math_cfg.verifier", verifier, f"env.{name}.math_verify_impl")
    verifier_type = settings.get("verifier_type")
    if verifier_type not in (None, "math"):
        out.problems.append(
            f"env.{name}.verifier_type: is {show_value(verifier_type)}, a grader other than the math one (NeMo-RL's "
            "multiple-choice graders score a letter): rlcore's math environment grades math answers; set it to "
            "'math' or remove it"
        )
    elif "verifier_type" in settings:
        out.ignored.append((f"env.{name}.verifier_type", "'math': the math grader, rlcore's"))
    for key in sorted(set(settings) - {"num_workers", "math_verify_impl", "verifier_type"}):
        out.ignored.append((f"env.{name}.{key}", MATH_ENV_UNREAD.get(key, "not read by NeMo-RL's math environment")))
