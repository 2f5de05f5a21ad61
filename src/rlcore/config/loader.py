"""Public entry points: load (file or dict, plus overrides), validate, dump."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ValidationError

from rlcore.config.errors import ConfigError
from rlcore.config.messages import join_path, problems_from_validation_error, show_value
from rlcore.config.overrides import apply_overrides
from rlcore.config.rules import check_rules
from rlcore.config.schemas import RLCoreConfig
from rlcore.config.unknown_keys import unknown_keys
from rlcore.config.yaml_io import dump_text, read_config_file

M = TypeVar("M", bound=BaseModel)


def validate_section(
    model_cls: type[M], data: Any, path: str, context: Mapping[str, Any] | None = None
) -> tuple[M | None, list[str]]:
    """Validate ``data`` with ``model_cls``; problems are prefixed with the dotted ``path``.

    Returns ``(model, [])`` on success and ``(None, problems)`` otherwise,
    with lines formatted like every other config problem. Used by the plugin
    registry for backend sections (``policy.vllm_cfg`` ...). ``None`` data is
    treated as an empty section. ``context`` is pydantic's validation context (a backend section gets its
    ``owner``). A key the class would ignore (a plugin's class without ``extra="forbid"``) is refused as
    an unknown key all the same.
    """
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        return None, [f"{join_path(path, [])}: expected a mapping (key: value), got {show_value(data)}"]
    try:
        model = model_cls.model_validate(dict(data), context=context)
    except ValidationError as exc:
        return None, problems_from_validation_error(exc, model_cls, path)
    if problems := unknown_keys(model_cls, data, path):  # a plugin's class that would drop a typo silently
        return None, problems
    return model, []


def load_config_dict(raw: Mapping[str, Any], overrides: Sequence[str] = ()) -> RLCoreConfig:
    """Validate a raw config dict (after applying ``overrides``) into an ``RLCoreConfig``.

    Schema problems are all reported together; the cross-field rules run once
    the schema is valid. Raises ConfigError listing every problem found.
    """
    data = apply_overrides(dict(raw), overrides)
    cfg, problems = validate_section(RLCoreConfig, data, "")
    if cfg is None:
        raise ConfigError(problems)
    problems = check_rules(cfg)
    if problems:
        raise ConfigError(problems)
    return cfg


#: The data settings that name input files: relative ones in a config file are relative to that file.
DATA_PATH_KEYS = (("train", "path"), ("validation", "path"), ("system_prompt_file",), ("prompt_file",))


def data_path_settings(data: Any) -> Iterator[tuple[dict[str, Any], str, str]]:
    """``(owner, key, path)`` of each data setting that names a file (:data:`DATA_PATH_KEYS`) in a raw ``data``
    section: ``owner[key] == path``."""
    for keys in DATA_PATH_KEYS:
        owner = data
        for key in keys[:-1]:
            owner = owner.get(key) if isinstance(owner, dict) else None
        value = owner.get(keys[-1]) if isinstance(owner, dict) else None
        if isinstance(value, str) and value:
            yield owner, keys[-1], value


def anchor_data_paths(raw: Any, base: Path) -> Any:
    """``raw`` with the relative data paths of a config file made relative to ``base`` (the directory of the file,
    after following a link).

    A config and the data it names travel together (``rlcore examples copy`` copies both); paths given on the
    command line stay relative to the working directory, and outputs (``logger.output_dir``) too.
    """
    data = raw.get("data") if isinstance(raw, Mapping) else None
    if not isinstance(data, Mapping):
        return raw
    data = copy.deepcopy(dict(data))
    for owner, key, value in data_path_settings(data):
        if not Path(value).expanduser().is_absolute():
            owner[key] = str(base / value)
    return {**raw, "data": data}


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> RLCoreConfig:
    """Load a YAML config file (None = all defaults), apply overrides, validate.

    Raises ConfigError (with ``.source`` set to the file) for a missing file,
    invalid YAML (``file:line:column``) or any invalid value.
    """
    raw = anchor_data_paths(read_config_file(path), Path(path).resolve().parent) if path is not None else {}
    try:
        return load_config_dict(raw, overrides)
    except ConfigError as exc:
        exc.source = str(path) if path is not None else None
        raise


def dump_config(cfg: BaseModel, fmt: Literal["yaml", "json"] = "yaml") -> str:
    """The resolved config as YAML or JSON text; loading it back gives an equal config.

    Backend sections appear under their original keys (``vllm_cfg`` ...).
    """
    return dump_text(cfg.model_dump(mode="json"), fmt)
