"""Unknown keys in a section whose config class would drop them silently.

A pydantic model ignores unknown keys unless its class says ``extra="forbid"``,
so a plugin whose config class forgot that would train with a typo'd setting
left at its default. rlcore's own classes forbid unknown keys; for a plugin's
class (backend, environment, algorithm) the core finds them itself, so the
user gets the same ``unknown key; did you mean ...`` line either way. A class
that says ``extra="allow"`` asked for extra keys and gets them.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from rlcore.config.messages import join_path, unknown_key_text

__all__ = ["ignores_unknown_keys", "unknown_keys"]


def ignores_unknown_keys(model: type[BaseModel]) -> bool:
    """Whether ``model`` drops unknown keys without a word (pydantic's default, ``extra="ignore"``)."""
    return model.model_config.get("extra") in (None, "ignore")


def unknown_keys(model: type[BaseModel], data: Any, path: str) -> list[str]:
    """One problem line per key of ``data`` (and of its nested sections) that ``model`` would ignore."""
    if not isinstance(data, Mapping):
        return []
    problems = []
    names = _accepted_names(model)
    for key, value in data.items():
        field = names.get(key)
        if field is None:
            if ignores_unknown_keys(model):
                problems.append(f"{join_path(path, [key])}: {unknown_key_text(key, model)}")
            continue
        nested = _section_class(model.model_fields[field].annotation)
        if nested is not None:
            problems += unknown_keys(nested, value, join_path(path, [key]))
    return problems


def _accepted_names(model: type[BaseModel]) -> dict[str, str]:
    """Every key ``model`` reads (field names and their string aliases), each mapped to its field name."""
    names = {}
    for name, field in model.model_fields.items():
        names[name] = name
        for alias in (field.alias, field.validation_alias):
            if isinstance(alias, str):
                names[alias] = name
    return names


def _section_class(annotation: Any) -> type[BaseModel] | None:
    """The model class of a nested section (``Sub`` or ``Sub | None``), None for any other field."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        models = [a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        return models[0] if len(models) == 1 else None
    return None
