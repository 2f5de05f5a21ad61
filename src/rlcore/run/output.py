"""What ``rlcore run`` shows: rlcore's own lines on the terminal, everything else in the run's logs.

A run's processes print a lot that is not for the user: Ray's start-up and
worker-death notices, vLLM's INFO lines, torch and transformers warnings, C++
logs. :func:`quiet_output` sends all of it to ``<output_dir>/logs/``:

- the driver's standard error (file descriptor 2, so C++ logs, Python logging
  and warnings alike) goes to ``driver.log``; the block gets a stream to the
  real terminal for what rlcore itself shows while it runs (the progress bar);
- every worker (training rank, engine) redirects its stdout and stderr to
  ``<worker name>.log`` there, at start (``WORKER_LOG_DIR_ENV``, see
  :mod:`rlcore.distributed.worker_host`), and Ray does not forward worker
  output to the driver.

``-v`` (``verbose=True``) leaves everything streaming to the terminal, as before.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Iterator, TextIO

from rlcore.distributed.worker_host import WORKER_LOG_DIR_ENV


@contextlib.contextmanager
def quiet_output(log_dir: Path, verbose: bool = False) -> Iterator[TextIO]:
    """For the block, route everything written to standard error to ``log_dir``; yields the terminal."""
    if verbose:
        yield sys.stderr
        return
    log_dir.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    saved = os.dup(2)
    with open(log_dir / "driver.log", "a") as log, os.fdopen(os.dup(saved), "w", buffering=1) as terminal:
        os.dup2(log.fileno(), 2)
        os.environ[WORKER_LOG_DIR_ENV] = str(log_dir.resolve())
        try:
            yield terminal
        finally:
            os.environ.pop(WORKER_LOG_DIR_ENV, None)
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
