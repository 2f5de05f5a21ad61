"""How a run stops on SIGINT/SIGTERM without losing the checkpoint that was due.

A signal raises :class:`StopRequested` in the main thread at once — except
while a checkpoint is being written (:meth:`StopOnSignals.hold`), where it is
raised as soon as the checkpoint is complete, so a stop never costs the
checkpoint that was due. A second signal always raises at once (the shutdown
that follows the first one is graceful, then forced; a second Ctrl-C skips
to forced).

A stop must never be lost. The handler runs between any two bytecodes of the main thread, and some of them
are where Python cannot raise: a ``__del__`` or a weakref callback (run by the garbage collector or by a
reference count reaching zero), a C extension's callback. There the interpreter hands the exception to
:func:`sys.unraisablehook`, prints "Exception ignored in ...", and the code around carries on; a run would
have trained on after a Ctrl-C. While a :class:`StopOnSignals` block is active its hook recognises a stop so
swallowed and has it raised again within milliseconds (or when the block ends, at the latest).

Not every loss goes through that hook: a C extension may keep the stop as its pending error and clear it
later (Ray's ``wait`` can, under load). So a block that a signal came to never ends normally: if nothing
was raised out of it, it raises the stop at its end (code inside that catches the stop on purpose gets it
again there). With ``force`` the deadline ends the process long before a late end of the block.
"""

from __future__ import annotations

import _thread
import contextlib
import signal
import sys
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
#: How often a stop swallowed where it was raised is signalled again until the handler has run.
RESEND_AFTER_S = 0.05


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
        self._lost: StopRequested | None = None  #: a stop swallowed where it was raised, not raised again yet
        self._redelivering = False  #: a stop this object was told of already is being raised again
        self._sent = self._handled = 0  #: signals this object sent itself, and how many of them the handler met
        self._previous_hook: Callable[[Any], object] = sys.__unraisablehook__
        self._active = False
        self._came_in_block: int | None = None  #: the first stop signal that came while this block was active
        self._main_thread = 0
        self._lost_lock = threading.RLock()  # a lost stop is raised again only while the block is active
        self._hook = self._unraisable  # one bound method: ``sys.unraisablehook is self._hook`` says it is ours

    def __enter__(self) -> StopOnSignals:
        self._lost = None
        self._came_in_block = None
        for signum in EXIT_CODES:  # refused outside the main thread
            self._previous[signum] = signal.signal(signum, self._handle)
        self._main_thread = threading.get_ident()
        self._previous_hook = sys.unraisablehook
        sys.unraisablehook = self._hook
        self._active = True
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        try:
            with self._lost_lock:
                self._active = False
                lost, self._lost = self._lost, None
            if exc is None and lost is not None:  # swallowed, and the block ended before it was raised again
                raise StopRequested(lost.signum) from lost
            if exc is None and self._came_in_block is not None:  # lost where no hook saw it, or caught
                raise StopRequested(self._came_in_block)
        finally:
            self._active = self._redelivering = False
            for signum, handler in self._previous.items():
                signal.signal(signum, handler)
            if sys.unraisablehook is self._hook:  # else another hook wraps this one: this one passes all on
                sys.unraisablehook = self._previous_hook

    def _handle(self, signum: int, _frame: Any) -> None:
        again = self._sent != self._handled  # a stop this object sent again (swallowed, or deferred)
        if again:
            self._handled = self._sent
            if not self._redelivering:  # one more wake-up of a stop raised again already
                return
            self._redelivering = False
            self._lost = None
        else:
            self.note(signum)
            self._redelivering, self._lost = False, None  # a stop swallowed before is raised now, with this one
        if self._holding and (again or not self._stopping):  # a first stop waits for the checkpoint
            self._pending = signum
            self._stopping = True
            return
        self._stopping = True
        raise StopRequested(signum)

    def _unraisable(self, unraisable: Any) -> None:
        """``sys.unraisablehook`` while the block is active: a stop swallowed by the interpreter is raised again
        once the swallowing code is left; anything else goes to the hook that was there before.

        Not from here: a pending signal runs its handler at the main thread's next check point, which would be
        in this hook, where the stop would be swallowed again. A thread of its own asks for it, started last
        and without waiting for it (``threading.Thread.start`` waits): it can only run, and ask, once the main
        thread lets go of the interpreter lock at a check point after this hook.
        """
        stop = _stop_in(unraisable.exc_value)
        if stop is None or not self._active:  # not a stop, or this block has ended
            self._previous_hook(unraisable)
            return
        self._lost = stop
        _thread.start_new_thread(self._raise_lost, ())

    def _raise_lost(self) -> None:
        """Signal the main thread again (a real signal: it also ends a sleep or a wait there) until its handler
        ran. Again, because a signal that comes between the main thread's letting go of the interpreter lock
        and its entering the blocking call does not end that call; extra ones before the handler runs merge
        into its one run, and one the handler meets after it ran is dropped (:attr:`_sent`)."""
        with self._lost_lock:
            if not self._active or self._lost is None:
                return
            self._redelivering = True
        while True:
            with self._lost_lock:  # the block does not end in between: its handler is the one that runs
                if not (self._active and self._redelivering and self._lost is not None):
                    return
                self._sent += 1
                signal.pthread_kill(self._main_thread, self._lost.signum)
            time.sleep(RESEND_AFTER_S)

    def redeliver(self, signum: int) -> None:
        """Raise (through the handler, now) a stop signal this object was told of already (:meth:`note`): a
        signal :func:`rlcore.distributed.startup_signals.deferred_signals` held back. Its deadline keeps
        running from the first delivery; it does not count as a second signal."""
        self._redelivering = True
        self._sent += 1
        try:
            signal.raise_signal(signum)
        finally:
            self._redelivering = False

    def note(self, signum: int) -> None:
        """A stop signal came (here, or to a block that defers signals such as ``ray.init``: its deadline runs
        from now too)."""
        if self.received is None:
            self.received = signum
        if self._active and self._came_in_block is None:
            self._came_in_block = signum
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


def _stop_in(exc: BaseException | None) -> StopRequested | None:
    """The :class:`StopRequested` that ``exc`` is or was raised from (a C extension's callback turns it into
    a ``SystemError`` caused by it), or None."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, StopRequested):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None
