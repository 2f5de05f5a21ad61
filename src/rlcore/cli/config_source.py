"""``--from rlcore|nemo-rl``: where a CLI config comes from, shared by ``rlcore config`` and ``rlcore run``."""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer


class ConfigSource(str, Enum):
    rlcore = "rlcore"
    nemo_rl = "nemo-rl"


SourceOpt = Annotated[
    ConfigSource,
    typer.Option(
        "--from",
        help="Config format: rlcore's own, or a NeMo-RL config (defaults:, ${...}, "
        "key=value overrides; see docs/nemo-rl-mapping.md).",
    ),
]
NemoOverridesArg = Annotated[
    list[str] | None,
    typer.Argument(
        help="With --from nemo-rl: NeMo-RL (Hydra) overrides key=value, +key=value, ++key=value, "
        "~key, applied before conversion.",
        show_default=False,
    ),
]


def load_cli_config(
    file: Path | None,
    overrides: Sequence[str] | None,
    source: ConfigSource,
    nemo_overrides: Sequence[str] | None,
    sources: dict[str, str] | None = None,
) -> tuple[Any, list[str]]:
    """The validated config and the ``ignored: ...`` lines (NeMo-RL only). Raises ConfigError. ``sources``, when
    given, receives the NeMo-RL key each rlcore key came from (for :func:`rlcore.nemo_rl.annotate`)."""
    from rlcore.config import ConfigError, load_config

    if source is ConfigSource.nemo_rl:
        if file is None:
            raise ConfigError(["--from nemo-rl needs a config file"])
        from rlcore.nemo_rl import load_nemo_rl_config

        loaded = load_nemo_rl_config(file, nemo_overrides or (), overrides or ())
        if sources is not None:
            sources.update(loaded.conversion.sources)
        return loaded.config, loaded.ignored_lines()
    if nemo_overrides:
        raise ConfigError(
            [
                f"'{nemo_overrides[0]}': overrides after the file are for --from nemo-rl; "
                "give rlcore overrides with -o KEY=VALUE"
            ]
        )
    try:
        return load_config(example_or_file(file), overrides or ()), []
    except ConfigError as exc:
        exc.problems[:] = [_with_rlcore_name(line) for line in exc.problems]
        if file is not None and _looks_like_nemo_rl(exc.problems):
            exc.problems.append(f"hint: {file} looks like a NeMo-RL config: read it with --from nemo-rl")
        raise


def _with_rlcore_name(line: str) -> str:
    """``logger.log_dir: unknown key`` told rlcore's name for NeMo-RL's key, when the two differ."""
    from rlcore.nemo_rl import rlcore_name

    path, _, why = line.partition(": ")
    if not why.startswith("unknown key") or "did you mean" in why or (native := rlcore_name(path)) is None:
        return line
    return (
        f"{path}: unknown key; it is NeMo-RL's name for rlcore's {native}: set {native} (or read the file with "
        "--from nemo-rl)"
    )


def named_as_written(problems: list[str], sources: dict[str, str] | None) -> list[str]:
    """``problems`` with the NeMo-RL key each rlcore key came from (``--from nemo-rl``), as the user wrote it."""
    if not sources:
        return problems
    from rlcore.nemo_rl import annotate

    return annotate(problems, sources)


def example_or_file(file: Path | None) -> Path | None:
    """``file`` itself, or the shipped example of that name when no such file exists (``grpo_tiny``)."""
    if file is None or file.exists() or file.parent != Path("."):
        return file
    from rlcore.examples import example_names, example_path

    return example_path(file.name) if file.name.removesuffix(".yaml") in example_names() else file


def _looks_like_nemo_rl(problems: list[str]) -> bool:
    markers = ("cluster.gpus_per_node:", "defaults:", "loss_fn:", "'${")
    return any(m in line for line in problems for m in markers)


def echo_ignored(lines: list[str]) -> None:
    """The one summary block of NeMo-RL keys rlcore does not use (stderr)."""
    for line in lines:
        typer.echo(line, err=True)


__all__ = ["ConfigSource", "NemoOverridesArg", "SourceOpt", "echo_ignored", "load_cli_config", "named_as_written"]
