"""``rlcore doctor``: check what a run needs on this machine, one line per check."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from rlcore.preflight import CheckResult


def doctor(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON document (checks + summary) and nothing else."),
    timeout: float = typer.Option(120.0, "--timeout", min=0.01, help="Seconds each engine import may take."),
) -> None:
    """Check torch, GPUs, backends, their engines and each backend's own checks, shared memory and ports.

    Exits 0 when no check fails (warnings allowed), 1 otherwise. Engines are
    imported in subprocesses; nothing is started and the network is not used.
    """
    from rlcore.preflight import preflight, summarize

    results = preflight(timeout_s=timeout)  # no config: the host and every installed plugin
    summary = summarize(results)
    if as_json:
        typer.echo(json.dumps({"checks": [r.as_dict() for r in results], "summary": summary}, indent=2))
    else:
        for line in render(results, summary):
            typer.echo(line)
    raise typer.Exit(summary["exit_code"])


def render(results: list[CheckResult], summary: dict[str, Any]) -> list[str]:
    """Aligned ``name  status  message`` lines, a ``fix:`` line under each one not ok, and a summary."""
    width = max((len(r.name) for r in results), default=0)
    lines = []
    for r in results:
        lines.append(f"{r.name.ljust(width)}  {r.status.ljust(4)}  {r.message}")
        if r.fix and r.status != "ok":
            lines.append(f"{''.ljust(width)}        fix: {r.fix}")
    verdict = {"ok": "ready", "warn": "ready, with warnings", "fail": "not ready"}[summary["status"]]
    lines.append(
        f"{summary['ok']} ok, {summary['warn']} warn, {summary['fail']} fail, {summary['skip']} skip: {verdict}"
    )
    return lines
