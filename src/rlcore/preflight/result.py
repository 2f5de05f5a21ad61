"""The record every doctor check returns, and the summary of a list of them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Status = Literal["ok", "warn", "fail", "skip"]
STATUSES: tuple[Status, ...] = ("ok", "warn", "fail", "skip")


@dataclass(frozen=True)
class CheckResult:
    """One line of ``rlcore doctor``.

    ``message`` is one line saying what was found; ``fix`` says what to do when
    the status is not ok (an exact command where there is one); ``details``
    holds the facts behind the line, for ``--json``.
    """

    name: str
    status: Status
    message: str
    fix: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(results: list[CheckResult]) -> dict[str, Any]:
    """Counts per status, the overall status and the exit code (1 only when a check failed)."""
    counts: dict[str, int] = {status: sum(r.status == status for r in results) for status in STATUSES}
    overall = "fail" if counts["fail"] else "warn" if counts["warn"] else "ok"
    return {**counts, "status": overall, "exit_code": 1 if counts["fail"] else 0}
