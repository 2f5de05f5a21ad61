"""``rlcore environments`` and ``rlcore algorithms``: list and inspect the installed plugins of one kind (reads
metadata only). Backends have their own command (:mod:`rlcore.cli.backends_cmd`): their rows carry capabilities."""

from __future__ import annotations

import json

import typer

from rlcore.cli.backends_cmd import print_table

#: The fields of a row (a backend's capabilities are not among them).
FIELDS = ("name", "kind", "plugin", "distribution", "version", "status", "problem")


def kind_app(kind: str, plural: str, what: str, none_installed: str) -> typer.Typer:
    """The ``list`` and ``show`` commands of the plugins of ``kind`` (``'environment'``, ``'algorithm'``), whose
    records the registry's method named ``plural`` lists."""
    app = typer.Typer(help=f"List and inspect installed {plural} ({what}).", no_args_is_help=True)

    @app.command("list")
    def list_kind(as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")) -> None:
        from rlcore.plugins import get_registry

        rows = [{key: r.as_dict()[key] for key in FIELDS} for r in getattr(get_registry(), plural)()]
        if as_json:
            typer.echo(json.dumps({plural: rows}, indent=2))
            return
        if not rows:
            typer.echo(none_installed)
            return
        print_table(rows, ["name", "distribution", "version", "status"])

    list_kind.__doc__ = f"List every discovered {kind} with its status, and plugins that failed to load. Never fails."

    @app.command("show")
    def show_kind(name: str = typer.Argument(..., help=f"{kind.capitalize()} name, or 'distribution:name'.")) -> None:
        from rlcore.plugins import BackendError, get_registry

        try:
            record = get_registry().find(name, kind=kind)
        except BackendError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
        info = {key: record.as_dict()[key] for key in FIELDS}
        if record.spec is not None:
            info.update(record.spec.model_dump(mode="json", exclude={"name"}))
        for key, value in info.items():
            typer.echo(f"{key}: {value}")

    show_kind.__doc__ = f"Show one {kind}'s spec and status."
    return app


def environments_app() -> typer.Typer:
    return kind_app(
        "environment",
        "environments",
        "what env.name selects",
        "No environments installed: rlcore's built-ins are missing; reinstall rlcore.",
    )


def algorithms_app() -> typer.Typer:
    return kind_app(
        "algorithm",
        "algorithms",
        "what a config's algorithm section selects",
        "No algorithms installed: rlcore's built-ins are missing; reinstall rlcore.",
    )
