"""Reading and writing YAML config text.

The loader is ``yaml.SafeLoader`` (its libyaml build where PyYAML has one, several times faster on
NeMo-RL's long files) with two fixes: ``1e-5`` is a float (plain
PyYAML follows YAML 1.1 and reads it as a string), and a key repeated in one
mapping is an error instead of silently keeping the last value.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from rlcore.config.errors import ConfigError


class ConfigLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    """Safe YAML loader for config files and override values."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[str, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            if key_node.value in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key '{key_node.value}' (first set on line {seen[key_node.value] + 1})",
                    key_node.start_mark,
                )
            seen[key_node.value] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def parse_yaml(text: str, source: str) -> Any:
    """Parse YAML text; syntax errors become a ConfigError naming ``source:line:column``."""
    try:
        return yaml.load(text, Loader=ConfigLoader)  # noqa: S506 - ConfigLoader is a SafeLoader
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        what = " ".join(p for p in (exc.context, exc.problem) if p) or "syntax error"
        raise ConfigError([f"{where}: invalid YAML: {what}"], source=source) from None
    except yaml.YAMLError as exc:
        raise ConfigError([f"{source}: invalid YAML: {exc}"], source=source) from None


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Load a YAML config file into a dict (an empty file is ``{}``)."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([f"{source}: no such file"], source=source) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([f"{source}: cannot read: {exc}"], source=source) from None
    data = parse_yaml(text, source)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            [f"{source}: expected a mapping (key: value) at the top level, got {type(data).__name__}"],
            source=source,
        )
    return data


def dump_text(data: Any, fmt: str = "yaml") -> str:
    """Serialize plain data as YAML (block style, key order kept) or indented JSON."""
    if fmt == "json":
        return json.dumps(data, indent=2) + "\n"
    if fmt == "yaml":
        return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
    raise ValueError(f"unknown format {fmt!r}; expected 'yaml' or 'json'")
