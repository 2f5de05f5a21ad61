"""SIGINT/SIGTERM during start-up: deferred across native initialisation, and a test hook that sends one.

A Python handler runs between any two bytecodes of the main thread. Raised half-way through ``ray.init``
(GCS, raylet and core worker half made), the stop's teardown ran ``ray.shutdown`` on a half-built core
worker: the driver died of SIGSEGV and left its ``rlray-<pid>-*`` directory (issue 44, item 11).
:func:`deferred_signals` records a signal that arrives inside such a block and delivers it to the program's
own handler once the block is done (after tearing down what the block started), so the stop is raised at a
safe point. A handler that is a bound method of an object with ``note(signum)`` (``rlcore run``'s
:class:`~rlcore.run.stopping.StopOnSignals`) is told at once, so its deadline runs while the block waits.

Test/debug hook: ``RLCORE_TEST_SIGNAL_AT=<phase>[:TERM]`` makes the process send itself SIGINT (or SIGTERM)
when start-up reaches ``<phase>`` (:data:`PHASES`), so tests interrupt each phase deterministically instead
of at wall-clock offsets. Unset, it does nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

SIGNAL_AT_ENV = "RLCORE_TEST_SIGNAL_AT"
SIGNAL_STAMP_ENV = "RLCORE_TEST_SIGNAL_STAMP"
#: Where :func:`signal_self_at` is called during ``rlcore run``'s start-up, in order.
PHASES = ("prepare", "ray_start", "ray_started", "workers", "engines", "first_step")
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def signal_self_at(phase: str) -> None:
    """Test hook: send the signal ``RLCORE_TEST_SIGNAL_AT`` asks for when it names ``phase``:
    ``<phase>[:TERM][:group]``, ``group`` sending it to the whole process group (what a scheduler does: Ray's
    GCS and raylet, started by this process, get it too). When ``RLCORE_TEST_SIGNAL_STAMP`` names a file, the
    wall-clock time of the signal is written there first."""
    wanted, *options = os.environ.get(SIGNAL_AT_ENV, "").split(":")
    if wanted != phase:
        return
    if stamp := os.environ.get(SIGNAL_STAMP_ENV):
        with open(stamp, "w") as f:
            f.write(repr(time.time()))
    signum = signal.SIGTERM if "TERM" in (o.upper() for o in options) else signal.SIGINT
    if "group" in options:
        os.killpg(os.getpgid(0), signum)
    else:
        os.kill(os.getpid(), signum)


@contextlib.contextmanager
def deferred_signals(cleanup: Callable[[], None] | None = None) -> Iterator[None]:
    """SIGINT/SIGTERM arriving inside the block are recorded, not raised; at its end, when one came,
    ``cleanup`` runs (still deferring) and the first signal is sent again to the handler the program had.

    Main thread only (elsewhere Python runs no handlers): there, a no-op.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous: dict[int, Any] = {}

    def record(signum: int, _frame: Any) -> None:
        received.append(signum)
        note = getattr(previous.get(signum), "__self__", None)  # the program's stop handler, told at once
        if callable(getattr(note, "note", None)):
            note.note(signum)

    previous.update({signum: signal.signal(signum, record) for signum in _STOP_SIGNALS})
    try:
        yield
    finally:
        try:
            if received and cleanup is not None:
                with contextlib.suppress(Exception):
                    cleanup()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        if received:  # the program's handler raises it here, at a safe point
            stopping = getattr(previous.get(received[0]), "__self__", None)
            if callable(getattr(stopping, "redeliver", None)):
                stopping.redeliver(received[0])  # told of it already: not counted as a second signal
            else:
                signal.raise_signal(received[0])
