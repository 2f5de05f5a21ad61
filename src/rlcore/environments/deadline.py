"""A deadline for the in-driver environment's call: ``env.timeout_s`` with ``env.num_workers: 0``.

Python cannot kill a function running in its own process; only the worker
environments (Ray actors, ``env.num_workers >= 1``) can be killed and
replaced. The in-driver environment stays in the driver all the same, because
that is what it promises: a reward function may keep state in its module that
the run's caller reads (tests do), a ``breakpoint()`` in it works, and
math_verify's own per-comparison timeouts (``signal.alarm``) work only on the
main thread. A process per call would cost a start-up per batch, and one
long-lived process would be ``env.num_workers: 1`` under another name. So:

- Called on the main thread (synchronous GRPO, validation: the usual case),
  the environment runs where it always did, and a watchdog thread interrupts
  it at the deadline with a signal (``SIGUSR2``, whose handler is rlcore's
  only during the call) that raises :class:`_Interrupted` inside it, again
  every second until the call returns. It is a ``BaseException``, so a
  reward's ``except Exception`` retry loop does not swallow it. A sleep, a
  socket read without a timeout, or a Python loop is stopped there.
- Called on another thread (async GRPO's rollout thread, which signals cannot
  reach), the call runs on a daemon thread of its own and is abandoned at the
  deadline: it may go on running, so the caller must not hand its environment
  object to the next call.

Either way the caller gets :class:`StepTimedOut` at the deadline. Neither
stops C code that holds the interpreter lock (a catastrophic regular
expression inside ``re``): for a timeout that kills, run the environment in
workers (``env.num_workers >= 1``).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any

#: How often the watchdog repeats its interrupt while the call has not returned.
_REPEAT_S = 1.0


class StepTimedOut(Exception):
    """The call passed its deadline. ``abandoned``: it was left running on a thread of its own."""

    def __init__(self, timeout_s: float, abandoned: bool) -> None:
        super().__init__(f"no result within {timeout_s:g}s")
        self.abandoned = abandoned


class _Interrupted(BaseException):
    """Raised inside the call at its deadline (not an ``Exception``: the call's own handlers let it through)."""


def call_with_deadline(fn: Callable[[], Any], timeout_s: float) -> Any:
    """``fn()``, or :class:`StepTimedOut` once ``timeout_s`` seconds have passed (see the module's docstring)."""
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "pthread_kill"):
        return _interrupting(fn, timeout_s)
    return _on_own_thread(fn, timeout_s)


def _interrupting(fn: Callable[[], Any], timeout_s: float) -> Any:
    running = [True]  # the handler raises only while the call runs
    lock, returned = threading.Lock(), threading.Event()
    main = threading.get_ident()

    def handler(signum: int, frame: Any) -> None:
        if running[0]:
            raise _Interrupted

    def watchdog() -> None:
        wait = timeout_s
        while not returned.wait(wait):
            with lock:  # never signals after the call returned, so never after the handler is restored
                if not running[0]:
                    return
                signal.pthread_kill(main, signal.SIGUSR2)
            wait = _REPEAT_S

    previous = signal.signal(signal.SIGUSR2, handler)
    thread = threading.Thread(target=watchdog, name="rlcore-environment-deadline", daemon=True)
    try:
        thread.start()
        try:
            return fn()
        finally:
            running[0] = False
    except _Interrupted:
        raise StepTimedOut(timeout_s, abandoned=False) from None
    finally:
        running[0] = False
        with lock:
            returned.set()
        signal.sigpending()  # a system call: a signal sent before the lock was taken is delivered on its return
        signal.signal(signal.SIGUSR2, previous)


def _on_own_thread(fn: Callable[[], Any], timeout_s: float) -> Any:
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller as it is
            outcome["error"] = exc

    thread = threading.Thread(target=target, name="rlcore-environment-step", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise StepTimedOut(timeout_s, abandoned=True)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


__all__ = ["StepTimedOut", "call_with_deadline"]
