"""What a NeMo-RL conversion produces (:class:`Conversion`), and the dict helpers the table's walker and
the handlers of :mod:`rlcore.nemo_rl.handlers` share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlcore.config.messages import show_value


@dataclass
class Conversion:
    """What came out of a NeMo-RL config."""

    config: dict[str, Any] = field(default_factory=dict)  # rlcore raw config (validate with load_config_dict)
    ignored: list[tuple[str, str]] = field(default_factory=list)  # (NeMo-RL path, why)
    problems: list[str] = field(default_factory=list)  # one line each, NeMo-RL paths
    sources: dict[str, str] = field(default_factory=dict)  # rlcore path -> the NeMo-RL path it came from
    notes: list[str] = field(default_factory=list)  # settings rlcore computes differently on purpose, one line each

    def ignored_lines(self) -> list[str]:
        """The block printed after a conversion: ``ignored: <path> (<why>)`` per unused key, then
        ``note: <what differs>`` per deliberate difference (:mod:`rlcore.nemo_rl.notes`)."""
        return [f"ignored: {path} ({why})" for path, why in self.ignored] + [f"note: {line}" for line in self.notes]


#: NeMo-RL's algorithms besides GRPO, each run by its own script that reads its own section.
ALGORITHMS = ("sft", "dpo", "distillation", "ppo", "rm")


def algorithm(nemo: dict[str, Any]) -> str:
    """Which NeMo-RL algorithm a config is for: 'grpo' with a ``grpo`` section (or none of the others), else the
    first of :data:`ALGORITHMS` with its section."""
    if isinstance(nemo.get("grpo"), dict):
        return "grpo"
    return next((name for name in ALGORITHMS if isinstance(nemo.get(name), dict)), "grpo")


#: NeMo-RL's algorithms rlcore does not run, by the section their script reads: the one line that refuses such a
#: config (instead of one "unknown key" line per key of that section).
UNSUPPORTED_ALGORITHMS: dict[str, str] = {}


def unsupported_algorithm(nemo: dict[str, Any]) -> str | None:
    """The refusal of a config for an algorithm rlcore does not run (:data:`UNSUPPORTED_ALGORITHMS`): one with such a
    section and none of the sections rlcore runs; None otherwise."""
    if any(isinstance(nemo.get(name), dict) for name in ("grpo", *ALGORITHMS)):
        return None
    return next((line for name, line in UNSUPPORTED_ALGORITHMS.items() if isinstance(nemo.get(name), dict)), None)


def is_sft(nemo: dict[str, Any]) -> bool:
    """An SFT config: an ``sft`` section and no ``grpo`` one (NeMo-RL's run_sft.py reads only its own sections)."""
    return algorithm(nemo) == "sft"


def without_unread(nemo: dict[str, Any], out: Conversion, unread: dict[str, str]) -> dict[str, Any]:
    """``nemo`` without the sections or keys of ``unread`` (paths one or two deep, with why), each listed as
    ignored: those NeMo-RL's script for the config's algorithm does not read, which rlcore would refuse."""
    kept = dict(nemo)
    for path, why in unread.items():
        head, _, tail = path.partition(".")
        parent = kept if not tail else kept.get(head)
        key = tail or head
        if not isinstance(parent, dict) or key not in parent:
            continue
        if tail:
            kept[head] = parent = dict(parent)
        del parent[key]
        out.ignored.append((path, why))
    return kept


def nemo_defaults(nemo: dict[str, Any], out: Conversion, section: str, defaults: dict[str, Any]) -> None:
    """The keys of ``section`` the config leaves out, as NeMo-RL's defaults (``defaults``: those that differ from
    rlcore's); an empty NeMo-RL section still selects its algorithm."""
    values = out.config.setdefault(section, {})
    for key, value in defaults.items():
        if key not in nemo[section]:
            values[key] = value
            out.sources[f"{section}.{key}"] = f"{section} (NeMo-RL's default {key})"


def unknown_problem(path: str, value: Any) -> str:
    """The problem line of a non-neutral key rlcore's reader does not know."""
    return (
        f"{path}: is {show_value(value)}, a NeMo-RL key rlcore's reader does not know (see "
        "docs/nemo-rl-mapping.md), so it cannot tell whether it changes training: remove it, or set it to "
        "null/false if that turns it off"
    )


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
