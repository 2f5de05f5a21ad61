"""A second model's policy section (distillation's ``teacher``, PPO's ``value``) as rlcore's settings over the
policy's: NeMo-RL writes such a section whole (often a YAML copy of ``policy``); rlcore keeps only what differs.

The section is converted as ``policy`` is (the table's walker, passed in), and each converted value that differs
from the policy's becomes the second model's own, under ``own_prefix`` (``distillation.teacher``, ``ppo.value``);
the others are the policy's already.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from rlcore.nemo_rl.conversion import Conversion, put, same

_MISSING = object()


def own_settings(
    section: dict[str, Any],
    out: Conversion,
    convert: Callable[[dict[str, Any]], Conversion],
    own_prefix: str,
    nemo_name: str,
) -> None:
    """Convert ``section`` (NeMo-RL's ``<nemo_name>`` without the keys the caller handled) as a policy and put each
    value that differs from the converted policy's under ``own_prefix``; problems and sources name ``nemo_name``."""
    converted = convert({"policy": section})
    out.problems.extend(renamed(line, nemo_name) for line in converted.problems)
    policy = leaves(out.config.get("policy", {}), "policy")
    for path, value in leaves(converted.config.get("policy", {}), "policy").items():
        if not same(value, policy.get(path, _MISSING)):
            own = own_prefix + "." + path[len("policy.") :]
            put(out.config, own, value)
            out.sources[own] = renamed(source(converted.sources, path), nemo_name)
    if section:
        out.ignored.append(
            (
                f"{nemo_name} (its other keys)",
                f"the same as the policy's settings, which it takes unless {own_prefix} sets its own, or ignored "
                "as they are under policy",
            )
        )


def leaves(node: Any, prefix: str) -> dict[str, Any]:
    """``{dotted path: value}`` of every leaf under ``node`` (an empty mapping is a leaf)."""
    if not isinstance(node, dict) or not node:
        return {prefix: node}
    return {path: leaf for key, value in node.items() for path, leaf in leaves(value, f"{prefix}.{key}").items()}


def source(sources: dict[str, str], path: str) -> str:
    """The NeMo-RL key an rlcore value came from (a value written as a whole section: the section's)."""
    while path and path not in sources:
        path = path.rpartition(".")[0]
    return sources.get(path, path)


def renamed(text: str, nemo_name: str) -> str:
    """``text`` about ``policy...`` as about the second model's section."""
    return re.sub(r"^policy\b", nemo_name, text)


__all__ = ["leaves", "own_settings", "renamed", "source"]
