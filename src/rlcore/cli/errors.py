"""How ``rlcore run`` reports an error: one line for the user, the full traceback in the run's log (or, when the
run's log directory cannot be written, in the temporary directory).

How a run stops on SIGINT/SIGTERM is :mod:`rlcore.run.stopping`.
"""

from __future__ import annotations

import tempfile
import time
import traceback
from pathlib import Path


def one_line(exc: BaseException) -> str:
    """The first meaningful line of an error, prefixed with its type unless it already names a worker or is
    rlcore's own one-line account of why the run stopped (:class:`rlcore.run.errors.RunError`)."""
    text = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
    from rlcore.distributed import WorkerError
    from rlcore.run.errors import RunError

    if isinstance(exc, (WorkerError, RunError)) or not text:
        return text or type(exc).__name__
    return f"{type(exc).__name__}: {text}"


def write_traceback(exc: BaseException, log_dir: Path) -> Path | None:
    """Append ``exc``'s full traceback to ``<log_dir>/rlcore.log``; when that cannot be written (a read-only or
    full disk, a path under a file), to a new ``rlcore-*.log`` in the temporary directory. Returns the file, or
    None when neither could be written."""
    text = "".join(traceback.format_exception(exc))
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        path = log_dir / "rlcore.log"
        with path.open("a") as f:
            f.write(text)
        return path
    except OSError:
        pass
    try:
        with tempfile.NamedTemporaryFile(
            "w", prefix=f"rlcore-{time.strftime('%Y%m%d-%H%M%S')}-", suffix=".log", delete=False
        ) as f:
            f.write(text)
        return Path(f.name)
    except OSError:
        return None


__all__ = ["one_line", "write_traceback"]
