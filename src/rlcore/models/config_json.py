"""A model's Hugging Face ``config.json`` as a plain dict, read where it already lies: no network, no transformers.

For the checks that must know a model's kind before anything loads it (is it a vision-language one?), from a
directory or the hub cache. huggingface_hub is imported inside the function.
"""

from __future__ import annotations

import json
import os
from typing import Any


def read_config_json(model: str) -> dict[str, Any] | None:
    """The ``config.json`` of ``model``: a directory's own, else (not a directory) a hub id's in the hub cache
    (``HF_HUB_CACHE``, as huggingface_hub read it at import). None when there is none to read: a directory
    without it, a path that is not a hub id, a hub id not in the cache, a file that is not a JSON object."""
    if os.path.isdir(model):
        path: str | None = os.path.join(model, "config.json")
    else:
        path = _cached(model)
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def has_vision_config(model: str) -> bool:
    """Whether ``model`` (see :func:`read_config_json`) is a vision-language model: its config has a
    ``vision_config``. A model whose config cannot be read counts as a text model."""
    return (read_config_json(model) or {}).get("vision_config") is not None


def model_experts(model: str) -> int | None:
    """The experts per mixture-of-experts layer of ``model``'s config (Qwen-MoE's ``num_experts`` or Mixtral's
    ``num_local_experts``), 0 for a dense model, None when its config cannot be read (see
    :func:`read_config_json`)."""
    config = read_config_json(model)
    if config is None:
        return None
    return int(config.get("num_experts") or config.get("num_local_experts") or 0)


def _cached(repo_id: str) -> str | None:
    """The path of ``repo_id``'s ``config.json`` in the hub cache (its default revision), or None."""
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(repo_id, "config.json")
    except ValueError:  # not a hub id (e.g. a path that does not exist)
        return None
    return cached if isinstance(cached, str) else None
