"""NeMo-RL's vision-language recipes (``vlm_grpo_3B.yaml`` run by ``examples/run_vlm_grpo.py``, ``sft_vlm_3B.yaml``
by ``run_vlm_sft.py``) as rlcore configs whose rows carry images (docs/vision.md).

A GRPO config whose train dataset is one of NeMo-RL's image datasets (:data:`~rlcore.nemo_rl.hub_datasets.VLM_NAMES`)
is a VLM run: NeMo-RL's script then builds every environment the data names as its VLM environment
(``nemo_rl/data/utils.py``: ``"vlm" if is_vlm``), so the section ``env_name`` names becomes rlcore's ``vlm``
environment (:mod:`rlcore.environments.vlm_rewards`), and the datasets' processor, ``vlm_hf_data_processor``, is how
rlcore builds their samples: the row's image (``data.image_key``) before the text of the prompt file formatted with
the question, no system prompt. ``policy.dtensor_cfg.automodel_kwargs.freeze_config.freeze_vision_tower`` is
``policy.freeze_vision_tower``.
"""

from __future__ import annotations

from typing import Any

from rlcore.config.messages import show_value
from rlcore.nemo_rl.conversion import Conversion, get, put
from rlcore.nemo_rl.hub_datasets import VLM_NAMES

#: NeMo-RL's processor of its image datasets (nemo_rl/data/processors.py).
VLM_PROCESSOR = "vlm_hf_data_processor"
#: rlcore's environment for NeMo-RL's VLM environment.
ENVIRONMENT = "vlm"
#: Keys of NeMo-RL's VLM environment section (VLMEnvConfig) and where they go; None: ignored, with why.
ENV_KEYS: dict[str, str | tuple[None, str]] = {
    "num_workers": "env.num_workers",
    "reward_functions": "env.vlm_cfg.reward_functions",
    "stop_strings": (
        None,
        "declared by NeMo-RL's VLMEnvConfig but read nowhere: generation stops at policy.generation.stop_strings",
    ),
}
AUTOMODEL = "policy.dtensor_cfg.automodel_kwargs"


def _set(out: Conversion, target: str, value: Any, source: str) -> None:
    put(out.config, target, value)
    out.sources[target] = source


def train_entry(data: Any) -> dict[str, Any]:
    """The train entry (``data.default``'s keys filled in), or the flat section; {} without one."""
    if not isinstance(data, dict):
        return {}
    if "train" not in data and "default" not in data:
        return data
    entry = data.get("train")
    return {**(data.get("default") or {}), **entry} if isinstance(entry, dict) else {}


def is_vlm_run(nemo: dict[str, Any]) -> bool:
    """Whether the config trains on one of NeMo-RL's image datasets (its VLM scripts' task)."""
    return str(train_entry(nemo.get("data")).get("dataset_name")) in VLM_NAMES


def env_section(nemo: dict[str, Any]) -> str | None:
    """The env section of a VLM run: the one the train entry's ``env_name`` names (None: not a VLM run)."""
    return train_entry(nemo.get("data")).get("env_name") if is_vlm_run(nemo) else None


def missing_env(where: str, out: Conversion) -> None:
    """A VLM run whose data names no environment: NeMo-RL's script reads ``env_name`` (a KeyError without)."""
    out.problems.append(
        f"{where}.env_name: is missing, and NeMo-RL's VLM script scores with the env section it names: give it, "
        "e.g. ++data.default.env_name=clevr-cogent"
    )


def processor(where: str, value: Any, out: Conversion) -> None:
    """``data.*.processor`` of a VLM run: the image datasets' own processor is how rlcore builds their samples;
    another one would not read their rows (NeMo-RL's raises for them)."""
    path = f"{where}.processor"
    if value == VLM_PROCESSOR:
        out.ignored.append(
            (
                path,
                "rlcore builds the image datasets' samples as vlm_hf_data_processor does: the row's image "
                "(data.image_key) before data.prompt_file formatted with the question, no system prompt",
            )
        )
    else:
        out.problems.append(
            f"{path}: is {show_value(value)}, a processor that does not read the image datasets' rows (NeMo-RL "
            f"formats them with {VLM_PROCESSOR}): set it to {VLM_PROCESSOR}"
        )


def environment(name: str, settings: dict[str, Any], out: Conversion) -> None:
    """``env.<name>`` of a VLM run (the section the data's ``env_name`` names, or one named ``vlm``) → rlcore's
    ``vlm`` environment, key by key."""
    _set(out, "env.name", ENVIRONMENT, out.sources.get("env.name", f"env.{name}"))
    for key, value in settings.items():
        path = f"env.{name}.{key}"
        target = ENV_KEYS.get(key)
        if isinstance(target, str):
            _set(out, target, value, path)
        elif target is not None:
            out.ignored.append((path, target[1]))
        elif value in (None, {}, []):
            out.ignored.append((path, "not read by NeMo-RL's VLM environment; its value changes nothing"))
        else:
            out.problems.append(
                f"{path}: is {show_value(value)}, a key NeMo-RL's VLM environment does not have (it reads "
                f"{', '.join(ENV_KEYS)}): remove it"
            )


# -- policy.dtensor_cfg.automodel_kwargs --------------------------------------------------------------------------


def automodel(nemo: dict[str, Any], out: Conversion) -> None:
    """NeMo Automodel's options of the dtensor backend: ``freeze_config`` maps (the vision tower, rlcore's
    ``policy.freeze_vision_tower``); the others choose Automodel's own implementations, which rlcore does not have."""
    if get(nemo, "policy.dtensor_cfg.enabled") is not True:
        return  # the section is not used (the table's walker lists it)
    section = get(nemo, "policy.dtensor_cfg")
    if not isinstance(section, dict) or "automodel_kwargs" not in section:
        return
    kwargs = section["automodel_kwargs"]
    if not kwargs:
        out.ignored.append((AUTOMODEL, "NeMo Automodel options: none set"))
        return
    if not isinstance(kwargs, dict):
        out.problems.append(f"{AUTOMODEL}: is {show_value(kwargs)}, not a mapping of options: remove it")
        return
    for key, value in kwargs.items():
        path = f"{AUTOMODEL}.{key}"
        if key == "freeze_config" and isinstance(value, dict):
            _freeze(value, path, out)
        elif value in (None, {}, []):
            out.ignored.append((path, "NeMo Automodel option, none set"))
        else:
            out.problems.append(
                f"{path}: is {show_value(value)}, a NeMo Automodel option rlcore's dtensor backend does not have "
                "(it loads Hugging Face models with their own modules): remove it"
            )


def _freeze(freeze: dict[str, Any], where: str, out: Conversion) -> None:
    for key, value in freeze.items():
        path = f"{where}.{key}"
        if key == "freeze_vision_tower":
            _set(out, "policy.freeze_vision_tower", value, path)
        elif key == "freeze_audio_tower":
            out.ignored.append((path, "rlcore's batches carry no audio: an audio tower gets no gradient either way"))
        elif key == "freeze_language_model" and value in (False, None):
            out.ignored.append((path, "false: the language model trains, as in rlcore"))
        elif key == "freeze_language_model":
            out.problems.append(
                f"{path}: is {show_value(value)}, but rlcore trains the language model: set it to false"
            )
        else:
            out.problems.append(
                f"{path}: is {show_value(value)}, a freeze option rlcore does not have (it has freeze_vision_tower, "
                "freeze_audio_tower, freeze_language_model): remove it"
            )
