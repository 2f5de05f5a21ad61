"""How a run stops on SIGINT/SIGTERM without losing the checkpoint that was due.

A signal raises :class:`StopRequested` in the main thread at once — except
while a checkpoint is being written (:meth:`StopOnSignals.hold`), where it is
raised as soon as the checkpoint is complete, so a stop never costs the
checkpoint that was due. A second signal always raises at once (the shutdown
that follows the first one is graceful, then forced; a second Ctrl-C skips
to forced).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

#: The shell's convention: 128 + signal number.
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
#: How long a stop may take before it is forced: the graceful shutdown (workers asked to close, the private
#: Ray stopped) ends well within it on an idle machine; a shutdown that cannot end (a dead Ray GCS, a worker
#: stuck in a collective) is cut here, so a signal always ends the run within about this long.
STOP_GRACE_S = 6.0
#: After a second signal: the user insists.
SECOND_SIGNAL_GRACE_S = 1.0


class StopRequested(BaseException):
    """The run was asked to stop by a signal.

    A ``BaseException`` like ``KeyboardInterrupt``: raised wherever the main thread happens to be (inside
    ``ray.get`` too), it must pass through every ``except Exception`` that turns failures into errors.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.signum, 128 + self.signum)


class StopOnSignals:
    """Context manager: SIGINT and SIGTERM raise :class:`StopRequested` (main thread only).

    With ``force`` given, the first signal also starts a deadline (:data:`STOP_GRACE_S`, less after a second
    signal, more while a checkpoint is being written): if the process still runs when it passes, ``force`` is
    called from a watchdog thread with the stop, to say so, stop what is left without waiting on anything,
    and end the process. The main thread may be where it cannot be interrupted (a Ray call waiting on a dead
    GCS after a signal to the whole process group killed it, a collective whose peer died): the deadline
    holds all the same. It stays armed until the process ends, as the interpreter's exit can wait on Ray too.
    """

    def __init__(self, force: Callable[[StopRequested], None] | None = None, grace_s: float = STOP_GRACE_S) -> None:
        self._previous: dict[int, Any] = {}
        self._holding = False
        self._pending: int | None = None
        self._stopping = False
        self.received: int | None = None  #: the first signal, once one came
        self._force = force
        self._grace_s = grace_s
        self._deadline = 0.0
        self._insisted = False
        self._watchdog: threading.Thread | None = None

    def __enter__(self) -> StopOnSignals:
        for signum in EXIT_CODES:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, _frame: Any) -> None:
        self.note(signum)
        if self._holding and not self._stopping:
            self._pending = signum
            self._stopping = True
            return
        self._stopping = True
        raise StopRequested(signum)

    def note(self, signum: int) -> None:
        """A stop signal came (here, or to a block that defers signals such as ``ray.init``: its deadline runs
        from now too)."""
        if self.received is None:
            self.received = signum
        if self._force is None:
            return
        now = time.monotonic()
        if self._watchdog is None:
            self._deadline = now + self._grace_s
            stop = StopRequested(self.received)
            self._watchdog = threading.Thread(target=self._watch, args=(stop,), name="rlcore-stop-deadline")
            self._watchdog.daemon = True
            self._watchdog.start()
        else:
            self._insisted = True
            self._deadline = min(self._deadline, now + SECOND_SIGNAL_GRACE_S)

    def _watch(self, stop: StopRequested) -> None:
        while True:
            now = time.monotonic()
            if self._holding and not self._insisted:  # a checkpoint being written: it is let finish
                self._deadline = max(self._deadline, now + self._grace_s)
            if now >= self._deadline:
                break
            time.sleep(min(self._deadline - now, 0.1))
        assert self._force is not None
        self._force(stop)

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Defer a first signal until the block (writing a checkpoint) is done."""
        self._holding = True
        try:
            yield
        finally:
            self._holding = False
        if self._pending is not None:
            raise StopRequested(self._pending)

    def stop_behind(self, exc: BaseException) -> StopRequested | None:
        """The stop that ``exc`` is the consequence of, or None.

        Raised inside a C extension (Ray's ``wait``), the stop comes out wrapped: as a ``SystemError``,
        or as the failure of the worker the driver was waiting on. After a signal, whatever ended the
        run is that signal's doing.
        """
        if isinstance(exc, StopRequested):
            return exc
        return StopRequested(self.received) if self.received is not None else None
