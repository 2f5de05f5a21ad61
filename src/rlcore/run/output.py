"""What ``rlcore run`` shows: rlcore's own lines on the terminal, everything else in the run's logs.

A run's processes print a lot that is not for the user: Ray's start-up and
worker-death notices, vLLM's INFO lines, torch and transformers warnings, C++
logs. :func:`quiet_output` sends all of it to ``<output_dir>/logs/``:

- the driver's standard error and standard output (file descriptors 2 and 1,
  so C++ logs, Python logging and warnings alike, and the ``(raylet) A worker
  died ...`` notices Ray's error listener prints to stdout) go to
  ``driver.log``; the block gets a stream to the real terminal for what rlcore
  itself shows while it runs (the progress bar); the run's summary is printed
  to stdout after the block;
- every worker (training rank, engine) redirects its stdout and stderr to
  ``<worker name>.log`` there, at start (``WORKER_LOG_DIR_ENV``, see
  :mod:`rlcore.distributed.worker_host`), and Ray does not forward worker
  output to the driver.

``-v`` (``verbose=True``) leaves everything streaming to the terminal, as before.

The logs are one level below the run's directory whatever it is called: NeMo-RL's ``logger.log_dir: logs``
becomes ``logger.output_dir: logs``, whose process logs are ``logs/`` itself, not ``logs/logs/``
(:func:`run_log_dir`).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from rlcore.distributed.worker_host import WORKER_LOG_DIR_ENV

LOGS = "logs"


def one_level(log_dir: Path) -> Path:
    """``log_dir`` without a doubled ``logs/logs`` at its end (a run directory that is itself named logs)."""
    return log_dir.parent if log_dir.name == LOGS and log_dir.parent.name == LOGS else log_dir


def run_log_dir(output_dir: str | Path) -> Path:
    """Where a run writing to ``output_dir`` (``logger.output_dir``) puts its process logs: ``<output_dir>/logs``,
    or ``output_dir`` itself when it is already a directory named logs."""
    return one_level(Path(output_dir) / LOGS)


@contextlib.contextmanager
def quiet_output(log_dir: Path, verbose: bool = False) -> Iterator[TextIO]:
    """For the block, route everything written to standard output and error to ``log_dir``; yields the terminal."""
    if verbose:
        yield sys.stderr
        return
    log_dir = one_level(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    streams = (sys.stdout, sys.stderr)
    for stream in streams:
        stream.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    with open(log_dir / "driver.log", "a") as log, os.fdopen(os.dup(saved[2]), "w", buffering=1) as terminal:
        for fd in saved:
            os.dup2(log.fileno(), fd)
        os.environ[WORKER_LOG_DIR_ENV] = str(log_dir.resolve())
        try:
            yield terminal
        finally:
            os.environ.pop(WORKER_LOG_DIR_ENV, None)
            for stream in streams:
                stream.flush()
            for fd, original in saved.items():
                os.dup2(original, fd)
                os.close(original)
