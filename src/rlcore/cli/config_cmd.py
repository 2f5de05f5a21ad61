"""``rlcore config``: validate, show and describe config files.

Problems go to stderr, one line each, and the exit code is 1; no traceback.
"""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from rlcore.config import ConfigError, RLCoreConfig, config_json_schema, dump_config, load_config

config_app = typer.Typer(help="Validate and inspect rlcore config files.", no_args_is_help=True)

FileArg = Annotated[Path, typer.Argument(help="YAML config file.", show_default=False)]
OverrideOpt = Annotated[
    Optional[list[str]],
    typer.Option("--override", "-o", help="Dotted override KEY=VALUE (VALUE is YAML); repeatable."),
]


class OutputFormat(str, Enum):
    yaml = "yaml"
    json = "json"


def _fail(problems: list[str]) -> None:
    for line in problems:
        typer.echo(line, err=True)
    raise typer.Exit(code=1)


def _load(file: Path, overrides: list[str] | None) -> RLCoreConfig:
    try:
        return load_config(file, overrides or ())
    except ConfigError as exc:
        _fail(exc.problems)
        raise  # unreachable: _fail exits


def _backend_problems(cfg: RLCoreConfig) -> list[str]:
    """Phase 2: the selected backends and their ``*_cfg`` sections, via the plugin registry."""
    try:
        from rlcore.plugins.registry import validate_backend_sections
    except ImportError as exc:
        # Only a registry that does not exist (yet) is skipped; a broken one is reported.
        if exc.name == "rlcore.plugins.registry" or "validate_backend_sections" in str(exc):
            return []
        raise
    return list(validate_backend_sections(cfg))


@config_app.command()
def validate(file: FileArg, override: OverrideOpt = None) -> None:
    """Check a config file: schema, cross-field rules and backend sections."""
    cfg = _load(file, override)
    problems = _backend_problems(cfg)
    if problems:
        _fail(problems)
    typer.echo(f"OK: {file} (training backend: {cfg.policy.training_backend}, world size {cfg.world_size})")


@config_app.command()
def show(
    file: FileArg,
    override: OverrideOpt = None,
    format: Annotated[OutputFormat, typer.Option("--format", "-f", help="Output format.")] = OutputFormat.yaml,
) -> None:
    """Print the resolved config (defaults filled in, overrides applied)."""
    cfg = _load(file, override)
    typer.echo(dump_config(cfg, format.value), nl=False)


@config_app.command()
def schema() -> None:
    """Print the JSON schema of the config file format."""
    typer.echo(json.dumps(config_json_schema(), indent=2))
