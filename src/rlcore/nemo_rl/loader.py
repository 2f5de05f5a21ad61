"""Read a NeMo-RL config file the way NeMo-RL does, without OmegaConf or Hydra.

- ``defaults:`` (a file name or a list of them, relative to the file that
  names them) is followed depth-first; later parents override earlier ones and
  the file itself overrides them all (``nemo_rl.utils.config.load_config``).
- Merging follows ``OmegaConf.merge``: mappings merge key by key, anything
  else (lists, scalars, ``null``) replaces; a mapping carrying
  ``_override_: true`` replaces the inherited one instead of merging into it.
- Overrides are Hydra's: ``key=value`` (the key must exist), ``+key=value``
  (the key must not exist), ``++key=value`` (either), ``~key`` (delete);
  values are YAML, so ``=null``, ``=[50]`` and ``=${policy.precision}`` work.
- Interpolations are resolved last, so an override of
  ``policy.max_total_sequence_length`` reaches every ``${...}`` that names it.

Problems are :class:`~rlcore.config.ConfigError` lines naming the file or
the override.
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from rlcore.config.errors import ConfigError
from rlcore.config.overrides import _split_key
from rlcore.config.yaml_io import ConfigLoader, read_config_file
from rlcore.nemo_rl.interpolation import resolve

OVERRIDE_MARKER = "_override_"


def merge(base: Any, override: Any) -> Any:
    """``OmegaConf.merge(base, override)`` on plain data (with NeMo-RL's ``_override_`` marker)."""
    if not isinstance(override, dict):
        return copy.deepcopy(override)
    if not isinstance(base, dict) or override.get(OVERRIDE_MARKER):
        return {k: copy.deepcopy(v) for k, v in override.items() if k != OVERRIDE_MARKER}
    out = dict(base)
    for key, value in override.items():
        if key == OVERRIDE_MARKER:
            continue
        out[key] = merge(base.get(key), value) if key in base else merge(None, value)
    return out


def unshared(node: Any) -> Any:
    """A copy in which no two places hold the same dict or list. YAML anchors and merge keys (``<<: *POLICY``)
    make aliases, which OmegaConf copies: an override of ``policy.x`` must not change the ``teacher`` copy."""
    if isinstance(node, dict):
        return {key: unshared(value) for key, value in node.items()}
    if isinstance(node, list):
        return [unshared(value) for value in node]
    return node


def load_with_defaults(path: str | Path, _chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The file merged over its ``defaults:`` chain (interpolations not resolved yet)."""
    path = Path(path)
    key = path.resolve()
    if key in _chain:
        cycle = " -> ".join(str(p.name) for p in (*_chain, key))
        raise ConfigError([f"{path}: defaults cycle: {cycle}"], source=str(path))
    data = unshared(read_config_file(path))
    defaults = data.pop("defaults", None)
    if defaults is None:
        return data
    names = [defaults] if isinstance(defaults, (str, Path)) else defaults
    if not isinstance(names, list) or not all(isinstance(n, (str, Path)) for n in names):
        raise ConfigError(
            [f"{path}: defaults: expected a file name or a list of file names, got {defaults!r}"], source=str(path)
        )
    base: dict[str, Any] = {}
    for name in names:
        parent = Path(name) if Path(name).is_absolute() else path.parent / str(name)
        if not parent.exists():
            raise ConfigError([f"{path}: defaults: {name}: no such file ({parent})"], source=str(path))
        base = merge(base, load_with_defaults(parent, (*_chain, key)))
    return merge(base, data)


def _lookup(node: Any, parts: list[Any]) -> tuple[Any, Any, bool]:
    """(container, last key, exists) for ``parts``; the container is None if a parent is missing."""
    for part in parts[:-1]:
        if isinstance(node, dict) and part in node and isinstance(node[part], (dict, list)):
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        else:
            return None, parts[-1], False
    last = parts[-1]
    if isinstance(node, dict):
        return node, last, last in node
    if isinstance(node, list) and isinstance(last, int):
        return node, last, 0 <= last < len(node)
    return None, last, False


def _suggest(node: Any, key: Any) -> str:
    if not isinstance(node, dict):
        return ""
    close = difflib.get_close_matches(str(key), [str(k) for k in node], n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def apply_hydra_overrides(config: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of ``config`` with Hydra-style overrides applied in order; problems all reported together."""
    out = copy.deepcopy(config)
    problems: list[str] = []
    for item in [overrides] if isinstance(overrides, str) else overrides:
        text = item.strip()
        mode = "set"
        for prefix, name in (("++", "force"), ("+", "add"), ("~", "delete")):
            if text.startswith(prefix):
                mode, text = name, text[len(prefix) :]
                break
        key, sep, raw = text.partition("=")
        parts = _split_key(key.strip())
        if parts is None or (not sep and mode != "delete"):
            problems.append(
                f"override '{item}': expected key=value, +key=value, ++key=value or ~key "
                "with a dotted key, e.g. policy.train_micro_batch_size=2"
            )
            continue
        try:
            value = yaml.load(raw, Loader=ConfigLoader) if sep else None  # noqa: S506 - a SafeLoader
        except yaml.YAMLError:
            value = raw  # Hydra accepts bare strings YAML would not (e.g. a:b); keep the text
        node, last, exists = _lookup(out, parts)
        if mode == "delete":
            if not exists:
                problems.append(f"override '{item}': '{key}' does not exist")
            else:
                del node[last]
            continue
        if mode == "set" and not exists:
            hint = _suggest(node, last) or f"; add it with ++{key}={raw}"
            problems.append(f"override '{item}': '{key}' is not in the config{hint}")
            continue
        if mode == "add" and exists:
            problems.append(f"override '{item}': '{key}' already exists; set it with {key}={raw} or ++{key}={raw}")
            continue
        if node is None:  # ++a.b.c with missing (or null) parents: create them
            node = out
            for part in parts[:-1]:
                if not isinstance(node, dict) or not isinstance(node.get(part, {}) or {}, dict):
                    node = None
                    break
                if not isinstance(node.get(part), dict):
                    node[part] = {}
                node = node[part]
            if node is None:
                problems.append(f"override '{item}': a parent of '{key}' is not a mapping")
                continue
        node[last] = value
    if problems:
        raise ConfigError(problems)
    return out


def load_nemo_rl_dict(path: str | Path, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The NeMo-RL config at ``path``: defaults followed, overrides applied, interpolations resolved."""
    try:
        raw = load_with_defaults(path)
        return resolve(apply_hydra_overrides(raw, overrides))
    except ConfigError as exc:
        exc.source = exc.source or str(path)
        raise


__all__ = ["apply_hydra_overrides", "load_nemo_rl_dict", "load_with_defaults", "merge"]
