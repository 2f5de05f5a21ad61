"""Read NeMo-RL configs: ``defaults:`` chains, ``${...}`` interpolations, Hydra overrides, and the mapping.

Typical use::

    from rlcore.nemo_rl import load_nemo_rl_config
    loaded = load_nemo_rl_config("grpo_math_1B.yaml", ["policy.model_name=tiny-llama"])
    loaded.config            # a validated RLCoreConfig
    loaded.ignored_lines()   # "ignored: <path> (<why>)", one per NeMo-RL key rlcore does not use

``rlcore config validate|show|convert --from nemo-rl FILE [key=value ...]`` and
``rlcore run --from nemo-rl FILE`` are this function. What maps where, and
what is ignored or rejected, is ``docs/nemo-rl-mapping.md`` (generated from
:data:`rlcore.nemo_rl.table.RULES`). Importing this package imports neither
torch nor ray.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlcore.config.errors import ConfigError
from rlcore.config.loader import load_config_dict, validate_section
from rlcore.config.policy import PolicyConfig
from rlcore.nemo_rl.convert import Conversion, convert, exact_rule
from rlcore.nemo_rl.loader import apply_hydra_overrides, load_nemo_rl_dict, load_with_defaults

_PATH = re.compile(r"^([\w.\[\]]+)(: )")


def annotate(problems: list[str], sources: Mapping[str, str]) -> list[str]:
    """Add ``(NeMo-RL: <path>)`` to problem lines about an rlcore path converted from another NeMo-RL path."""
    out = []
    for line in problems:
        match = _PATH.match(line)
        path = match.group(1) if match else ""
        prefix = next(
            (
                p
                for p in sorted(sources, key=len, reverse=True)
                if path == p or path.startswith(p + ".") or path.startswith(p + "[")
            ),
            None,
        )
        if match and prefix is not None and sources[prefix] != prefix:
            source = sources[prefix] + path[len(prefix) :] if "," not in sources[prefix] else sources[prefix]
            rest = line[match.end() :]
            if "," not in source and source.rsplit(".", 1)[-1] == path.rsplit(".", 1)[-1]:
                # the same setting under another section: the fix names the key the user wrote, not rlcore's
                rest = re.sub(rf"\bset {re.escape(path)}(?=[ =])", f"set {source}", rest)
            line = f"{path} (NeMo-RL: {source}): {rest}"
        out.append(line)
    return out


@dataclass
class NemoRLConfig:
    """A NeMo-RL config read into rlcore: the validated config and how it was converted."""

    config: Any  # RLCoreConfig
    conversion: Conversion

    def ignored_lines(self) -> list[str]:
        return self.conversion.ignored_lines()


def convert_file(path: str | Path, overrides: Sequence[str] = ()) -> Conversion:
    """The conversion of a NeMo-RL file; raises ConfigError for loading or mapping problems."""
    conversion = convert(load_nemo_rl_dict(path, overrides))
    if conversion.problems:
        raise ConfigError(conversion.problems, source=str(path))
    return conversion


def load_nemo_rl_config(
    path: str | Path, overrides: Sequence[str] = (), rlcore_overrides: Sequence[str] = ()
) -> NemoRLConfig:
    """Read, convert and validate a NeMo-RL config file.

    ``overrides`` are NeMo-RL's (Hydra) overrides, applied before interpolation and conversion;
    ``rlcore_overrides`` are rlcore dotted overrides applied to the converted config. Raises
    ConfigError with every problem, each line naming the NeMo-RL path (or the rlcore path and the
    NeMo-RL key it came from).
    """
    conversion = convert_file(path, overrides)
    try:
        cfg = load_config_dict(conversion.config, rlcore_overrides)
    except ConfigError as exc:
        raise ConfigError(annotate(exc.problems, conversion.sources), source=str(path)) from None
    return NemoRLConfig(cfg, conversion)


def policy_config_from_nemo_rl(policy: Mapping[str, Any]) -> Any:
    """A validated rlcore ``PolicyConfig`` from NeMo-RL's ``config["policy"]`` dict (what NeMo-RL code
    passes to its ``Policy``); ignored keys are dropped, unsupported ones raise ConfigError."""
    conversion = convert({"policy": dict(policy)})
    if conversion.problems:
        raise ConfigError(conversion.problems)
    model, problems = validate_section(PolicyConfig, conversion.config.get("policy", {}), "policy")
    if model is None:
        raise ConfigError(annotate(problems, conversion.sources))
    return model


def nemo_rl_policy_hint(problems: list[str]) -> list[str]:
    """A hint line when the unknown keys of a policy dict's ``problems`` are NeMo-RL's own (NeMo-RL code
    passes its ``config["policy"]`` to ``Policy``), else nothing."""
    unknown = [line.split(":", 1)[0] for line in problems if ": unknown key" in line]
    if any((rule := exact_rule(path)) is not None and rule.action != "map" for path in unknown):
        return [
            "hint: this is a NeMo-RL policy config; convert it with "
            "rlcore.nemo_rl.policy_config_from_nemo_rl(config), which lists what rlcore ignores or rejects"
        ]
    return []


def rlcore_name(path: str) -> str | None:
    """rlcore's key for NeMo-RL's ``path`` when the two differ (``logger.log_dir`` -> ``logger.output_dir``), for a
    line about a NeMo-RL key written into an rlcore config; None when rlcore has no such renaming."""
    rule = exact_rule(path)
    if rule is None or rule.action != "map" or rule.target in (None, path) or "*" in rule.nemo:
        return None
    return rule.target


__all__ = [
    "Conversion",
    "NemoRLConfig",
    "annotate",
    "apply_hydra_overrides",
    "convert",
    "convert_file",
    "load_nemo_rl_config",
    "load_nemo_rl_dict",
    "load_with_defaults",
    "nemo_rl_policy_hint",
    "policy_config_from_nemo_rl",
    "rlcore_name",
]
