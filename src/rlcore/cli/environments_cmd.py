"""``rlcore environments``: list and inspect installed environments (reads metadata only)."""

from __future__ import annotations

import json

import typer

from rlcore.cli.backends_cmd import print_table

environments_app = typer.Typer(help="List and inspect installed environments (what env.name selects).",
                               no_args_is_help=True)

#: The fields of an environment's row (a backend's capabilities and plugin API version are not among them).
FIELDS = ("name", "kind", "plugin", "distribution", "version", "status", "problem")


@environments_app.command("list")
def list_environments(as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")) -> None:
    """List every discovered environment with its status, and plugins that failed to load. Never fails."""
    from rlcore.plugins import get_registry

    rows = [{key: r.as_dict()[key] for key in FIELDS} for r in get_registry().environments()]
    if as_json:
        typer.echo(json.dumps({"environments": rows}, indent=2))
        return
    if not rows:
        typer.echo("No environments installed: rlcore's built-ins are missing; reinstall rlcore.")
        return
    print_table(rows, ["name", "distribution", "version", "status"])


@environments_app.command("show")
def show_environment(name: str = typer.Argument(..., help="Environment name, or 'distribution:name'.")) -> None:
    """Show one environment's spec and status."""
    from rlcore.plugins import BackendError, get_registry

    try:
        record = get_registry().find(name, kind="environment")
    except BackendError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1)
    info = {key: record.as_dict()[key] for key in FIELDS}
    if record.spec is not None:
        info.update(record.spec.model_dump(mode="json", exclude={"name"}))
    for key, value in info.items():
        typer.echo(f"{key}: {value}")
