"""``rlcore backends``: list and inspect installed backends (reads metadata only)."""

from __future__ import annotations

import json

import typer

backends_app = typer.Typer(help="List and inspect installed backends.", no_args_is_help=True)


@backends_app.command("list")
def list_backends(
    kind: str | None = typer.Option(None, "--kind", help="Only 'training' or 'generation' backends."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """List every discovered training and generation backend with its status. Never fails on a bad plugin."""
    from rlcore.plugins import get_registry

    if kind == "environment":
        typer.echo("error: environments are their own kind: list them with 'rlcore environments list'", err=True)
        raise typer.Exit(2)
    if kind not in (None, "training", "generation"):
        raise typer.BadParameter("--kind must be 'training' or 'generation'")
    rows = [r.as_dict() for r in get_registry().backends(kind)]
    if as_json:
        typer.echo(json.dumps({"backends": rows}, indent=2))
        return
    if not rows:
        typer.echo("No backends installed. Install one, e.g. 'pip install rl-dtensor rl-vllm[cpu]'.")
        return
    print_table(rows, ["name", "kind", "distribution", "version", "status", "capabilities"])


def print_table(rows: list[dict], headers: list[str]) -> None:
    """``rows`` as aligned columns, each row's problem on the line under it."""
    table = [[",".join(r[h]) if isinstance(r[h], list) else str(r[h]) for h in headers] for r in rows]
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(headers)]
    typer.echo("  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip())
    for row, r in zip(table, rows):
        typer.echo("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if r["problem"]:
            typer.echo(f"    -> {r['problem']}")


@backends_app.command("show")
def show_backend(name: str = typer.Argument(..., help="Backend name, or 'distribution:name'.")) -> None:
    """Show one backend's spec and status."""
    from rlcore.plugins import BackendError, get_registry

    registry = get_registry()
    try:
        record = registry.find(name)
    except BackendError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    info = record.as_dict()
    if record.spec is not None:
        info.update(record.spec.model_dump(mode="json", exclude={"name", "kind", "capabilities"}))
    for key, value in info.items():
        typer.echo(f"{key}: {value}")
