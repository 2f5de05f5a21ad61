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
    if (full := full_disk_line(exc)) is not None:
        return full
    return f"{type(exc).__name__}: {text}"


def full_disk_line(exc: BaseException) -> str | None:
    """rlcore's line for a write a full disk stopped (an ``OSError`` with ENOSPC or EDQUOT in ``exc``'s chain),
    naming the file and what to do; None for another error. A save's own line (:class:`rlcore.run.checkpoints.
    DiskFull`) also says which checkpoint is whole."""
    import shutil

    from rlcore.run.checkpoints import full_disk_error

    if (full := full_disk_error(exc)) is None:
        return None
    where = Path(full.filename) if isinstance(full.filename, str) else None
    free = ""
    if where is not None:
        existing = next((p for p in (where, *where.parents) if p.exists()), None)
        if existing is not None:
            free = f", {shutil.disk_usage(existing).free // 2**20} MiB free there now"
    writing = f" while writing {where}" if where is not None else ""
    return (
        f"{full.strerror or 'No space left on device'}{writing}{free}; nothing of the run's checkpoints was "
        "changed by it; free some space (or choose logger.output_dir on another disk) and run again (with --resume "
        "to continue from the newest checkpoint)"
    )


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


__all__ = ["full_disk_line", "one_line", "write_traceback"]
