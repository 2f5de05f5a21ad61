"""``rlcore examples``: the example configs shipped with rlcore, to list and copy."""

from __future__ import annotations

from pathlib import Path

import typer

examples_app = typer.Typer(help="The example configs shipped with rlcore.", no_args_is_help=True)


@examples_app.command("list")
def list_examples() -> None:
    """Each example's name and what it shows; run one with `rlcore run NAME`."""
    from rlcore.examples import DEFAULT_EXAMPLE, example_names, example_summary

    names = example_names()
    width = max(len(n) for n in names)
    for name in names:
        default = "  (what `rlcore run` runs without a config)" if name == DEFAULT_EXAMPLE else ""
        typer.echo(f"{name.ljust(width)}  {example_summary(name)}{default}")


@examples_app.command("copy")
def copy_example(
    name: str = typer.Argument(..., help="An example name from `rlcore examples list`."),
    dest: Path | None = typer.Argument(None, help="File or directory to write (default: ./NAME.yaml)."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing file."),
) -> None:
    """Write an example config to edit; never overwrites without --force."""
    from rlcore.examples import example_path

    try:
        source = example_path(name)
    except KeyError as exc:
        typer.echo(f"error: {exc.args[0]}", err=True)
        raise typer.Exit(1) from None
    target = dest or Path(source.name)
    if target.is_dir():
        target = target / source.name
    if target.exists() and not force:
        typer.echo(f"error: {target} exists; give --force to overwrite it", err=True)
        raise typer.Exit(1)
    data_files = example_data_files(source)
    for relative in data_files:
        copy = target.parent / relative
        if copy.exists() and not force:
            typer.echo(f"error: {copy} exists; give --force to overwrite it", err=True)
            raise typer.Exit(1)
    target.write_text(source.read_text())
    for relative in data_files:  # the data the example names, relative to it as in the package
        (target.parent / relative).parent.mkdir(parents=True, exist_ok=True)
        (target.parent / relative).write_bytes((source.parent / relative).read_bytes())
    also = f" and {', '.join(map(str, data_files))}" if data_files else ""
    typer.echo(f"wrote {target}{also}; run it with: rlcore run {target}")


def example_data_files(config: Path) -> list[Path]:
    """The files an example's data section names by relative path (they ship beside it), each once (an example
    may validate on its training file)."""
    from rlcore.config.loader import data_path_settings
    from rlcore.config.yaml_io import read_config_file

    data = read_config_file(config).get("data") or {}
    named = [Path(value) for _, _, value in data_path_settings(data) if not Path(value).is_absolute()]
    return list(dict.fromkeys(named))


__all__ = ["examples_app"]
