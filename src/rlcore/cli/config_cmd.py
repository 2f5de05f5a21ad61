"""``rlcore config``: validate, show, convert and describe config files.

Problems go to stderr, one line each, and the exit code is 1; no traceback.
``--from nemo-rl`` reads a NeMo-RL config (see :mod:`rlcore.nemo_rl`); the NeMo-RL
keys rlcore does not use are listed once, as ``ignored: ...`` lines on stderr.
"""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from rlcore.cli.config_source import (
    ConfigSource,
    NemoOverridesArg,
    SourceOpt,
    echo_ignored,
    load_cli_config,
    named_as_written,
)
from rlcore.config import ConfigError, ResolvedConfig, RLCoreConfig, config_json_schema, dump_config, resolve

config_app = typer.Typer(help="Validate and inspect rlcore config files.", no_args_is_help=True)

FileArg = Annotated[Path, typer.Argument(help="YAML config file.", show_default=False)]
OverrideOpt = Annotated[
    list[str] | None,
    typer.Option("--override", "-o", help="Dotted override KEY=VALUE (VALUE is YAML); repeatable."),
]


class OutputFormat(str, Enum):
    yaml = "yaml"
    json = "json"


def _fail(problems: list[str]) -> None:
    for line in problems:
        typer.echo(line, err=True)
    raise typer.Exit(code=1)


def _load(
    file: Path,
    overrides: list[str] | None,
    source: ConfigSource = ConfigSource.rlcore,
    nemo_overrides: list[str] | None = None,
    sources: dict[str, str] | None = None,
) -> tuple[RLCoreConfig, list[str]]:
    try:
        return load_cli_config(file, overrides, source, nemo_overrides, sources)
    except ConfigError as exc:
        _fail(exc.problems)
        raise  # unreachable: _fail exits


def _resolve(cfg: RLCoreConfig, ignored: list[str], sources: dict[str, str] | None = None) -> ResolvedConfig:
    """Phase 2: the config against the installed backends, as ``rlcore run`` would take it when it has a
    generation section (layout, batch plan, backend sections); problems exit with the ignored keys listed, each
    naming the NeMo-RL key it came from (``sources``, ``--from nemo-rl``)."""
    try:
        resolved = resolve(cfg, run=cfg.policy.generation is not None)
    except ConfigError as exc:
        echo_ignored(ignored)
        _fail(named_as_written(exc.problems, sources))
        raise  # unreachable: _fail exits
    echo_ignored(ignored)
    for notice in resolved.notices:
        typer.echo(notice, err=True)
    return resolved


NoFilesOpt = Annotated[
    bool,
    typer.Option(
        "--no-files",
        help="Check the config alone, for a run on another machine: skip what depends on this one "
        "(CUDA, the user's code, data and prompt files, models and tokenizers, the hub).",
    ),
]


@config_app.command()
def validate(
    file: FileArg,
    nemo_overrides: NemoOverridesArg = None,
    override: OverrideOpt = None,
    source: SourceOpt = ConfigSource.rlcore,
    no_files: NoFilesOpt = False,
) -> None:
    """Check a config file: schema, cross-field rules, backends, their sections and layout, and what `rlcore run`
    checks before Ray starts (CUDA, the environment class and reward function, files, models, tokenizers)."""
    from rlcore.preflight import preflight, problem_lines
    from rlcore.preflight.user_code import import_from_working_directory

    import_from_working_directory()  # as rlcore run imports the user's code
    sources: dict[str, str] = {}
    cfg, ignored = _load(file, override, source, nemo_overrides, sources)
    resolved = _resolve(cfg, ignored, sources)
    if problems := problem_lines(preflight(resolved, files=not no_files, sources=sources)):
        _fail(problems)
    what = f"NeMo-RL config, {len(ignored)} keys ignored; " if source is ConfigSource.nemo_rl else ""
    typer.echo(
        f"OK: {file} ({what}training backend: {cfg.policy.training_backend}, world size {cfg.world_size}, "
        f"data parallel {resolved.policy.data_parallel_size})"
    )


@config_app.command()
def show(
    file: FileArg,
    nemo_overrides: NemoOverridesArg = None,
    override: OverrideOpt = None,
    format: Annotated[OutputFormat, typer.Option("--format", "-f", help="Output format.")] = OutputFormat.yaml,
    source: SourceOpt = ConfigSource.rlcore,
) -> None:
    """Print the resolved config (defaults filled in, overrides applied)."""
    cfg, ignored = _load(file, override, source, nemo_overrides)
    echo_ignored(ignored)
    typer.echo(dump_config(cfg, format.value), nl=False)


@config_app.command()
def convert(
    file: FileArg,
    output: Annotated[Path, typer.Option("--output", "-o", help="Where to write the rlcore config (YAML).")],
    nemo_overrides: NemoOverridesArg = None,
    override: Annotated[
        list[str] | None,
        typer.Option("--override", help="rlcore dotted override KEY=VALUE applied after conversion; repeatable."),
    ] = None,
    source: SourceOpt = ConfigSource.nemo_rl,
) -> None:
    """Write a NeMo-RL config as a native rlcore config (which `rlcore config validate` accepts)."""
    if source is not ConfigSource.nemo_rl:
        _fail(["convert: only --from nemo-rl configs need converting"])
    sources: dict[str, str] = {}
    cfg, ignored = _load(file, override, source, nemo_overrides, sources)
    _resolve(cfg, ignored, sources)
    args = " ".join([str(file), *(nemo_overrides or [])])
    header = [
        f"# rlcore config converted from the NeMo-RL config: {args}",
        "# by `rlcore config convert --from nemo-rl` (mapping: docs/nemo-rl-mapping.md).",
        *(f"# {line}" for line in ignored),
    ]
    output.write_text("\n".join(header) + "\n" + dump_config(cfg, "yaml"), encoding="utf-8")
    typer.echo(
        f"wrote {output} (training backend: {cfg.policy.training_backend}, world size {cfg.world_size}, "
        f"{len(ignored)} NeMo-RL keys ignored)"
    )


def _print_or_write(text: str, write: bool, target: str, command: str) -> None:
    """A generated doc page: printed, or (``--write``) written to its place in the repository."""
    if not write:
        typer.echo(text, nl=False)
        return
    path = Path(target)
    if not path.parent.is_dir():
        _fail([f"{command} --write: no {path.parent}/ directory here; run it from the repository root"])
    path.write_text(text, encoding="utf-8")
    typer.echo(f"wrote {path}")


_WRITE_HELP = "Write {} (run from the repository root) instead of printing."


@config_app.command("nemo-rl-table")
def nemo_rl_table(
    write: Annotated[bool, typer.Option("--write", help=_WRITE_HELP.format("docs/nemo-rl-mapping.md"))] = False,
) -> None:
    """The NeMo-RL → rlcore mapping table (docs/nemo-rl-mapping.md is this output)."""
    from rlcore.nemo_rl.doc import OUTPUT_PATH, mapping_markdown

    _print_or_write(mapping_markdown(), write, OUTPUT_PATH, "nemo-rl-table")


@config_app.command()
def reference(
    write: Annotated[bool, typer.Option("--write", help=_WRITE_HELP.format("docs/config-reference.md"))] = False,
) -> None:
    """Every config key with its type, default and readers (docs/config-reference.md is this output)."""
    from rlcore.config.reference import OUTPUT_PATH, reference_markdown

    _print_or_write(reference_markdown(), write, OUTPUT_PATH, "reference")


@config_app.command()
def schema() -> None:
    """Print the JSON schema of the config file format."""
    typer.echo(json.dumps(config_json_schema(), indent=2))
