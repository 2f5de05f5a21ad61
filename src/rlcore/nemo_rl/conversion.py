"""What a NeMo-RL conversion produces (:class:`Conversion`), and the dict helpers the table's walker and
the handlers of :mod:`rlcore.nemo_rl.handlers` share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Conversion:
    """What came out of a NeMo-RL config."""

    config: dict[str, Any] = field(default_factory=dict)  # rlcore raw config (validate with load_config_dict)
    ignored: list[tuple[str, str]] = field(default_factory=list)  # (NeMo-RL path, why)
    problems: list[str] = field(default_factory=list)  # one line each, NeMo-RL paths
    sources: dict[str, str] = field(default_factory=dict)  # rlcore path -> the NeMo-RL path it came from

    def ignored_lines(self) -> list[str]:
        return [f"ignored: {path} ({why})" for path, why in self.ignored]


def same(a: Any, b: Any) -> bool:
    """Equality that keeps bools apart from numbers (``False`` is not ``0`` here)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b


def is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    return any(same(value, n) for n in neutral)


def get(data: dict[str, Any], path: str, default: Any = None) -> Any:
    node: Any = data
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def put(data: dict[str, Any], path: str, value: Any) -> None:
    parts = path.split(".")
    node = data
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[parts[-1]] = value
