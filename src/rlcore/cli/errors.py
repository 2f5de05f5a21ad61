"""How ``rlcore run`` reports an error: one line for the user, the full traceback in the run's log.

How a run stops on SIGINT/SIGTERM is :mod:`rlcore.run.stopping`.
"""

from __future__ import annotations

import traceback
from pathlib import Path


def one_line(exc: BaseException) -> str:
    """The first meaningful line of an error, prefixed with its type unless it already names a worker."""
    text = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
    from rlcore.distributed import WorkerError

    if isinstance(exc, WorkerError) or not text:
        return text or type(exc).__name__
    return f"{type(exc).__name__}: {text}"


def write_traceback(exc: BaseException, log_dir: Path) -> Path:
    """Append ``exc``'s full traceback to ``<log_dir>/rlcore.log``; returns the file."""
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / "rlcore.log"
    with path.open("a") as f:
        f.write("".join(traceback.format_exception(exc)))
    return path


__all__ = ["one_line", "write_traceback"]
