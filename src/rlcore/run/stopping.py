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
from collections.abc import Iterator
from typing import Any

#: The shell's convention: 128 + signal number.
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


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
    """Context manager: SIGINT and SIGTERM raise :class:`StopRequested` (main thread only)."""

    def __init__(self) -> None:
        self._previous: dict[int, Any] = {}
        self._holding = False
        self._pending: int | None = None
        self._stopping = False
        self.received: int | None = None  #: the first signal, once one came

    def __enter__(self) -> StopOnSignals:
        for signum in EXIT_CODES:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.received is None:
            self.received = signum
        if self._holding and not self._stopping:
            self._pending = signum
            self._stopping = True
            return
        self._stopping = True
        raise StopRequested(signum)

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
