"""SIGINT/SIGTERM during start-up: deferred across native initialisation, and a test hook that sends one.

A Python handler runs between any two bytecodes of the main thread. Raised half-way through ``ray.init``
(GCS, raylet and core worker half made), the stop's teardown ran ``ray.shutdown`` on a half-built core
worker: the driver died of SIGSEGV and left its ``rlray-<pid>-*`` directory (issue 44, item 11).
:func:`deferred_signals` records a signal that arrives inside such a block and delivers it to the program's
own handler once the block is done (after tearing down what the block started), so the stop is raised at a
safe point.

Test/debug hook: ``RLCORE_TEST_SIGNAL_AT=<phase>[:TERM]`` makes the process send itself SIGINT (or SIGTERM)
when start-up reaches ``<phase>`` (:data:`PHASES`), so tests interrupt each phase deterministically instead
of at wall-clock offsets. Unset, it does nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator

SIGNAL_AT_ENV = "RLCORE_TEST_SIGNAL_AT"
#: Where :func:`signal_self_at` is called during ``rlcore run``'s start-up, in order.
PHASES = ("prepare", "ray_start", "ray_started", "workers", "engines", "first_step")
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def signal_self_at(phase: str) -> None:
    """Test hook: send this process the signal ``RLCORE_TEST_SIGNAL_AT`` asks for when it names ``phase``."""
    wanted, _, which = os.environ.get(SIGNAL_AT_ENV, "").partition(":")
    if wanted == phase:
        os.kill(os.getpid(), signal.SIGTERM if which.upper() == "TERM" else signal.SIGINT)


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
    previous = {
        signum: signal.signal(signum, lambda signum, _frame: received.append(signum)) for signum in _STOP_SIGNALS
    }
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
        if received:
            signal.raise_signal(received[0])  # the program's handler raises it here, at a safe point
