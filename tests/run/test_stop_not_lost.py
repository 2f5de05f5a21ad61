"""A Ctrl-C is never lost: a stop raised where Python cannot raise still ends the block.

``tests/distributed/test_runtime.py``'s signal test once ended with "DID NOT RAISE" in CI. The handler runs
between any two bytecodes of the main thread; when those are a finalizer's (the garbage collector running
``__del__`` methods or weakref callbacks of what earlier tests left, during Ray's task submission), Python
prints "Exception ignored in ..." and the stop is gone. Here the signal arrives, deterministically, while
a finalizer runs; a plain raising handler shows the stop is lost that way (the negative control).
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import time
import weakref
from collections.abc import Iterator

import pytest

from rlcore.distributed.startup_signals import deferred_signals
from rlcore.run.stopping import SECOND_SIGNAL_GRACE_S, StopOnSignals, StopRequested


def _signal_and_run_on() -> None:
    """Send SIGINT to this process and run a few more bytecodes, where the Python handler runs."""
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(100):
        pass


class SignalledWhileFinalized:
    def __del__(self) -> None:
        _signal_and_run_on()


@pytest.fixture
def unraisable() -> Iterator[list[BaseException | None]]:
    """What reaches the ``sys.unraisablehook`` that was there before the block."""
    seen: list[BaseException | None] = []
    previous = sys.unraisablehook
    sys.unraisablehook = lambda u: seen.append(u.exc_value)
    try:
        yield seen
    finally:
        sys.unraisablehook = previous


def _drop_by_refcount() -> None:
    finalized = SignalledWhileFinalized()
    del finalized


def _drop_by_gc() -> None:
    cycle = SignalledWhileFinalized()
    cycle.me = cycle  # type: ignore[attr-defined]
    del cycle
    gc.collect()


class WrapsWhileFinalized:
    """A finalizer that turns what it meets into its own error (as a C extension's callback turns the stop
    into a ``SystemError``): the stop is its cause."""

    def __del__(self) -> None:
        try:
            _signal_and_run_on()
        except BaseException as exc:
            raise RuntimeError("cleanup failed") from exc


def _drop_wrapping() -> None:
    finalized = WrapsWhileFinalized()
    del finalized


def _drop_with_weakref_callback() -> None:
    class Owner:
        pass

    owner = Owner()
    weakref.finalize(owner, _signal_and_run_on)
    del owner


FINALIZERS = [
    pytest.param(_drop_by_refcount, id="__del__"),
    pytest.param(_drop_by_gc, id="gc-collected-cycle"),
    pytest.param(_drop_with_weakref_callback, id="weakref-callback"),
    pytest.param(_drop_wrapping, id="wrapped-in-__del__"),
]


@pytest.mark.parametrize("finalize", FINALIZERS)
def test_a_plain_raising_handler_loses_a_stop_raised_in_a_finalizer(finalize, unraisable):
    """The negative control: what the handler did before. The block ends normally; the stop went to the
    unraisable hook."""

    def plain(signum: int, _frame: object) -> None:
        raise StopRequested(signum)

    previous = signal.signal(signal.SIGINT, plain)
    try:
        finalize()
        time.sleep(0.01)
    finally:
        signal.signal(signal.SIGINT, previous)
    (lost,) = unraisable
    assert isinstance(lost, StopRequested) or isinstance(lost.__cause__, StopRequested), repr(lost)


@pytest.mark.parametrize("finalize", FINALIZERS)
def test_a_stop_swallowed_in_a_finalizer_still_stops_the_block(finalize, unraisable):
    signals = StopOnSignals()
    carried_on = []
    began = time.monotonic()
    with pytest.raises(StopRequested) as caught, signals:
        finalize()
        carried_on.append("past the finalizer")
        time.sleep(5.0)  # a blocking call: the stop raised again ends it
        carried_on.append("after the sleep")
    assert carried_on in ([], ["past the finalizer"]), carried_on  # raised again at once, not at the block's end
    assert time.monotonic() - began < 2.5
    stop = signals.stop_behind(caught.value)
    assert stop is not None and stop.exit_code == 130
    assert unraisable == [], "a stop raised again is not 'Exception ignored'"
    assert sys.unraisablehook is not signals._hook  # the block's hook is gone with it


def test_a_stop_swallowed_by_the_blocks_last_statement_is_raised_by_its_end(unraisable):
    signals = StopOnSignals()
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(StopRequested), signals:
        _drop_by_refcount()
    assert signal.getsignal(signal.SIGINT) is before
    assert unraisable == []


def test_a_stop_that_never_leaves_the_block_is_raised_at_its_end(unraisable):
    """A stop dropped where no hook sees it (a C extension that clears its pending error; here, code that
    catches it) still stops the block: at its end, with the signal's exit code. The block's end is the
    latest; what ran in between ran. Without a signal the block ends normally."""
    carried_on = []
    with pytest.raises(StopRequested) as caught, StopOnSignals():
        try:
            _signal_and_run_on()
        except StopRequested:
            pass
        carried_on.append("after the dropped stop")
    assert carried_on == ["after the dropped stop"]
    assert caught.value.exit_code == 130
    with StopOnSignals():  # a fresh block: nothing came to it
        carried_on.append("a block with no signal")
    assert unraisable == []


def test_an_unraisable_that_is_not_a_stop_passes_through(unraisable):
    class BrokenFinalizer:
        def __del__(self) -> None:
            raise ValueError("a broken __del__")

    with StopOnSignals():
        broken = BrokenFinalizer()
        del broken
        time.sleep(0.05)
    assert [type(e) for e in unraisable] == [ValueError]


def test_a_signal_deferred_by_ray_init_is_not_counted_twice():
    """``deferred_signals`` tells the stop at once (its deadline runs) and raises it at the block's end:
    that is the same signal, not a second one that would cut the grace to ``SECOND_SIGNAL_GRACE_S``."""
    forced: list[float] = []
    signals = StopOnSignals(force=lambda stop: forced.append(time.monotonic()), grace_s=SECOND_SIGNAL_GRACE_S + 1.5)
    began = time.monotonic()
    with pytest.raises(StopRequested), signals:
        with deferred_signals():
            os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(SECOND_SIGNAL_GRACE_S + 0.5)
    assert forced == [], "the deferred signal was counted as a second one"
    end = time.monotonic() + 5
    while not forced and time.monotonic() < end:
        time.sleep(0.01)
    assert forced and forced[0] - began >= SECOND_SIGNAL_GRACE_S + 1.4
