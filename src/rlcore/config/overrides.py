"""Dotted ``key.sub=value`` overrides applied to a raw config dict, and one raw section merged over another."""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from typing import Any

import yaml

from rlcore.config.errors import ConfigError
from rlcore.config.yaml_io import ConfigLoader

# `a.b[0].c` or `a.b.0.c`: names separated by dots, list indices either way.
_TOKEN = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def _split_key(key: str) -> list[str | int] | None:
    parts: list[str | int] = []
    pos = 0
    while pos < len(key):
        if parts:  # after the first name: `.name`, `.0` or `[0]`
            if key[pos] == ".":
                pos += 1
            elif key[pos] != "[":
                return None
        match = _TOKEN.match(key, pos)
        if not match:
            return None
        name, index = match.groups()
        parts.append(int(index) if index is not None else name)
        pos = match.end()
    return parts or None


def _set(raw: dict[str, Any], parts: list[str | int], value: Any) -> str | None:
    """Set ``value`` at ``parts`` inside ``raw``; returns a problem text or None."""
    node: Any = raw
    walked: list[str] = []
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            index = int(part) if isinstance(part, int) or str(part).isdigit() else None
            if index is None or index >= len(node):
                return f"'{'.'.join(walked)}' is a list of {len(node)} entries; no entry '{part}'"
            if last:
                node[index] = value
            elif node[index] is None:
                node[index] = {}
            node = node[index]
        elif isinstance(node, dict):
            key = str(part)
            if last:
                node[key] = value
            else:
                if node.get(key) is None:
                    node[key] = {}  # create missing (or null) intermediate sections
                node = node[key]
        else:
            return f"'{'.'.join(walked)}' is {node!r}, not a mapping"
        walked.append(str(part))
    return None


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return a copy of ``raw`` with each ``key.sub=value`` override applied in order.

    The value is parsed as YAML (``=2`` is an int, ``=null`` is None,
    ``=[1,2]`` a list, ``=`` alone None); missing intermediate keys are created.
    All malformed overrides are reported together in one ConfigError.
    """
    if isinstance(overrides, str):
        overrides = [overrides]  # a lone string is one override, not its characters
    result = copy.deepcopy(raw)
    problems: list[str] = []
    for item in overrides:
        key, sep, text = item.partition("=")
        parts = _split_key(key.strip()) if sep else None
        if parts is None:
            problems.append(
                f"override '{item}': expected KEY=VALUE with a dotted key, e.g. policy.train_micro_batch_size=2"
            )
            continue
        try:
            value = yaml.load(text, Loader=ConfigLoader)  # noqa: S506 - a SafeLoader
        except yaml.YAMLError as exc:
            what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            problems.append(f"override '{item}': invalid YAML value: {what}")
            continue
        problem = _set(result, parts, value)
        if problem:
            problems.append(f"override '{item}': {problem}")
    if problems:
        raise ConfigError(problems)
    return result


def merged_section(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` merged into ``base`` key by key (nested mappings merged, other values replaced): a second model's
    own settings over the policy's (distillation's teacher, PPO's critic)."""
    out = dict(base)
    for key, value in over.items():
        nested = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = merged_section(out[key], value) if nested else value
    return out
