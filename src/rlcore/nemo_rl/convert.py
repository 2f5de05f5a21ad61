"""NeMo-RL config dict → rlcore config dict, following :data:`rlcore.nemo_rl.table.RULES`.

Every key of the NeMo-RL config ends in exactly one of three places: mapped
into the rlcore config, reported as ignored (it changes nothing rlcore
computes), or reported as an error (it would change training or generation
and rlcore does not implement it). Keys the table does not know are ignored
when their value is null/false/0/empty and errors otherwise.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Callable
from typing import Any

from rlcore.config.messages import show_value
from rlcore.nemo_rl import distillation, dpo, handlers, notes, ppo, reward_model, rm, sft
from rlcore.nemo_rl.conversion import (
    Conversion,
    algorithm,
    get,
    is_neutral,
    put,
    same,
    unknown_problem,
    unsupported_algorithm,
)
from rlcore.nemo_rl.table import RULES, UNKNOWN_NEUTRAL, Rule


def _match(pattern: str, path: str) -> bool:
    p, q = pattern.split("."), path.split(".")
    return len(p) == len(q) and all(fnmatch.fnmatchcase(b, a) for a, b in zip(p, q))


@functools.cache
def exact_rule(path: str) -> Rule | None:
    """The first rule whose pattern matches ``path`` (cached: the rules are constant, NeMo-RL's keys repeat)."""
    for rule in RULES:
        if _match(rule.nemo, path):
            return rule
    return None


@functools.cache
def _has_descendant_rules(path: str) -> bool:
    depth = path.count(".") + 1
    for rule in RULES:
        parts = rule.nemo.split(".")
        if len(parts) > depth and _match(".".join(parts[:depth]), path):
            return True
    return False


def _top_k(value: Any) -> Any:
    return None if isinstance(value, int) and not isinstance(value, bool) and value <= 0 else value


def _false_is_automatic(value: Any) -> Any:
    """NeMo-RL's ``force_on_policy_ratio: false`` → rlcore's null (skip the prev pass exactly when redundant)."""
    return None if value is False else value


def _true_is_automatic(value: Any) -> Any:
    """NeMo-RL's ``sequence_packing.enabled: true`` → rlcore's null (pack where the training backend can)."""
    return None if value is True else value


def _negative_is_off(value: Any) -> Any:
    """NeMo-RL's ``val_period: -1`` (it validates when the period is > 0) → rlcore's 0 (no periodic validation)."""
    return 0 if isinstance(value, int) and not isinstance(value, bool) and value < 0 else value


def _none_is_empty(value: Any) -> Any:
    """NeMo-RL's ``env_vars: null`` → rlcore's ``{}`` (no variables)."""
    return {} if value is None else value


TRANSFORMS: dict[str, Callable[[Any], Any]] = {
    "none_is_empty": _none_is_empty,
    "top_k": _top_k,
    "false_is_automatic": _false_is_automatic,
    "true_is_automatic": _true_is_automatic,
    "negative_is_off": _negative_is_off,
}


class _Walker:
    def __init__(self, nemo: dict[str, Any], out: Conversion) -> None:
        self.nemo, self.out = nemo, out
        self.handlers: set[str] = set()

    def ignore(self, path: str, why: str) -> None:
        self.out.ignored.append((path, why))

    def error(self, path: str, value: Any, what: str, fix: str) -> None:
        self.out.problems.append(f"{path}: is {show_value(value)}, but rlcore does not support {what}: {fix}")

    def apply(self, rule: Rule, path: str, value: Any) -> None:
        if rule.action == "map":
            target = rule.target if "*" not in (rule.target or "") else path
            fn = TRANSFORMS.get(rule.transform or "")
            put(self.out.config, target, fn(value) if fn else value)
            self.out.sources[target] = path
        elif rule.action == "custom":
            self.handlers.add(rule.handler or "")
        elif rule.action == "ignore":
            self.ignore(path, rule.note)
        elif rule.action in ("neutral", "gate"):
            if is_neutral(value, rule.neutral):
                self.ignore(path, f"{rule.note}: not supported by rlcore")
            else:
                fix = " or ".join(show_value(n) for n in rule.neutral if not isinstance(n, (dict, list)))
                self.error(path, value, rule.note, f"set it to {fix or 'empty'} or remove it")

    def walk(self, node: Any, path: str, inherited: Rule | None = None) -> None:
        rule = exact_rule(path) if path else None
        if rule is None and node in (None, {}) and path and _has_descendant_rules(path):
            return  # a section written as null or {}: the same as leaving it out (rlcore's defaults)
        if isinstance(node, dict) and node:
            if rule is not None and rule.action == "section":
                self.section(rule, node, path)
                return
            if path and self.gate_of(node, path):
                return
            if rule is None or (rule.action == "ignore" and _has_descendant_rules(path)):
                self.walk_children(node, path, rule if rule is not None else inherited, own=rule is not None)
                return
        if rule is not None:
            self.apply(rule, path, node)
        elif inherited is not None:
            self.ignore(path, inherited.note)
        else:
            self.unknown(path, node)

    def walk_children(self, node: dict[str, Any], path: str, rest: Rule | None = None, own: bool = False) -> None:
        """Each key by its own rule; keys with none fall under ``rest`` (an ignoring ancestor), reported once."""
        skipped = self.sibling_gates(node, path)
        leftover = False
        for key, value in node.items():
            child = f"{path}.{key}" if path else str(key)
            if child in skipped:
                continue
            if rest is not None and exact_rule(child) is None and not _has_descendant_rules(child):
                leftover = True
                continue
            self.walk(value, child, rest)
        if leftover and rest is not None:
            self.ignore(f"{path} (its other keys)" if own else path, rest.note)

    def section(self, rule: Rule, node: dict[str, Any], path: str) -> None:
        assert rule.active_if is not None
        switch, values = rule.active_if
        active = is_neutral(get(self.nemo, switch), values)
        if active:
            self.walk_children(node, path)
            return
        for key in rule.keep:
            if key in node:
                self.walk(node[key], f"{path}.{key}")
        if any(k not in rule.keep for k in node):
            self.ignore(path, f"not used: {switch} is {show_value(get(self.nemo, switch))}")

    def gate_of(self, node: dict[str, Any], path: str) -> bool:
        """A section switched by its own gate key (``<path>.enabled``): handled as a unit."""
        for key, value in node.items():
            rule = exact_rule(f"{path}.{key}")
            if rule is not None and rule.action == "gate" and rule.covers is None:
                if is_neutral(value, rule.neutral):
                    self.ignore(path, f"{rule.note}: off; not supported by rlcore")
                else:
                    self.error(f"{path}.{key}", value, rule.note, f"set {path}.{key}=false or remove the section")
                return True
        return False

    def sibling_gates(self, node: dict[str, Any], path: str) -> set[str]:
        """Gates covering sibling keys (``use_dynamic_sampling`` → ``dynamic_sampling_*``): paths to skip."""
        skipped: set[str] = set()
        for key, value in node.items():
            gate_path = f"{path}.{key}" if path else str(key)
            rule = exact_rule(gate_path)
            if rule is None or rule.action != "gate" or rule.covers is None:
                continue
            covered = {f"{path}.{k}" for k in node if any(_match(c, f"{path}.{k}") for c in rule.covers)}
            skipped |= covered | {gate_path}
            if is_neutral(value, rule.neutral):
                self.ignore(gate_path, f"{rule.note}: off; not supported by rlcore")
                self.out.ignored += [(c, f"only used by {gate_path}") for c in sorted(covered - {gate_path})]
            else:
                self.error(gate_path, value, rule.note, f"set it to {show_value(rule.neutral[0])}")
        return skipped

    def unknown(self, path: str, value: Any) -> None:
        if is_neutral(value, UNKNOWN_NEUTRAL):
            self.ignore(path, "not known to rlcore's NeMo-RL reader; its value changes nothing")
        else:
            self.out.problems.append(unknown_problem(path, value))


#: Per algorithm: ``nemo`` without what NeMo-RL's script for it does not read (each listed as ignored).
UNREAD: dict[str, Callable[[dict[str, Any], Conversion], dict[str, Any]]] = {
    "sft": sft.without_unread_sections,
    "dpo": dpo.without_unread_sections,
    "distillation": distillation.without_unread_loss_keys,
    "rm": rm.own_sections,
}


def convert(nemo: dict[str, Any]) -> Conversion:
    """Map a resolved NeMo-RL config dict (see :func:`rlcore.nemo_rl.loader.load_nemo_rl_dict`)."""
    out = Conversion()
    if (refusal := unsupported_algorithm(nemo)) is not None:
        out.problems.append(refusal)  # one line for the algorithm, not one per key of its section
        return out
    if (unread := UNREAD.get(algorithm(nemo))) is not None:
        nemo = unread(nemo, out)
    walker = _Walker(nemo, out)
    walker.walk(nemo, "")
    for name in handlers.ORDER:
        handlers.HANDLERS[name](nemo, out)
    # last, and given this walker: it converts the teacher's settings as a policy and compares them with the student's
    distillation.teacher(nemo, out, convert)
    ppo.value(nemo, out, convert)
    reward_model.policy_keys(nemo, out, convert)
    notes.add_notes(nemo, out)
    return out


__all__ = ["Conversion", "convert", "exact_rule", "get", "is_neutral", "put", "same"]
