"""Moved: stopping on signals is :mod:`rlcore.run.stopping`, error lines :mod:`rlcore.cli.errors` (re-exported)."""

from rlcore.cli.errors import one_line, write_traceback
from rlcore.run.stopping import EXIT_CODES, StopOnSignals, StopRequested

__all__ = ["EXIT_CODES", "StopOnSignals", "StopRequested", "one_line", "write_traceback"]
