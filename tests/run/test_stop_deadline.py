"""A signal always ends the run (issue 52, item 3): the stop's deadline.

SIGTERM to the whole process group (what SLURM and Kubernetes send) reaches Ray's GCS and raylet too, which the
driver started in its own group; the driver's graceful stop then waited on the dead GCS and exited 60 s later
with rc 1 and nothing on the terminal. :class:`rlcore.run.stopping.StopOnSignals` now gives a stop a deadline:
past it, a watchdog thread says the line, stops the private Ray through its reaper and ends the process with
the signal's code. The unit cases use a recording ``force``; the run cases signal a real ``rlcore run``'s
process group at a named phase (``RLCORE_TEST_SIGNAL_AT=<phase>:TERM:group``).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from rlcore.distributed.startup_signals import SIGNAL_STAMP_ENV, deferred_signals
from rlcore.run.stopping import SECOND_SIGNAL_GRACE_S, STOP_GRACE_S, StopOnSignals, StopRequested
from tests.cli.test_startup_interrupt import CLEANUP_BOUND_S, interrupted_run

#: The issue's bound: a signal gives its exit code and one line within this long.
LINE_WITHIN_S = 10.0


def _stopping(grace_s: float) -> tuple[StopOnSignals, list[tuple[float, str]]]:
    forced: list[tuple[float, str]] = []
    return StopOnSignals(force=lambda stop: forced.append((time.monotonic(), str(stop))), grace_s=grace_s), forced


def _wait_for(forced: list, within_s: float) -> None:
    end = time.monotonic() + within_s
    while not forced and time.monotonic() < end:
        time.sleep(0.01)


def test_a_stop_that_does_not_end_the_process_is_forced_after_its_grace():
    signals, forced = _stopping(grace_s=0.3)
    began = time.monotonic()
    with pytest.raises(StopRequested), signals:
        os.kill(os.getpid(), signal.SIGTERM)
    _wait_for(forced, 5)
    assert [name for _, name in forced] == ["SIGTERM"]
    assert 0.3 <= forced[0][0] - began < 2.0


def test_a_second_signal_cuts_the_grace_and_a_checkpoint_being_written_extends_it():
    signals, forced = _stopping(grace_s=0.6)
    with pytest.raises(StopRequested), signals:  # raised when the hold ends
        with signals.hold():  # a checkpoint is being written: the first signal waits for it
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1.0)
            assert forced == []  # past the grace, but the save is still going: it is let finish
            began = time.monotonic()
    # the hold ended: the deadline runs again from its end (0.6 s)
    _wait_for(forced, 5)
    assert 0.5 <= forced[0][0] - began < 2.0
    signals, forced = _stopping(grace_s=30)
    with pytest.raises(StopRequested), signals:
        os.kill(os.getpid(), signal.SIGINT)
    with pytest.raises(StopRequested), signals:
        began = time.monotonic()
        os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C: the user insists
    _wait_for(forced, 5)
    assert forced and forced[0][0] - began < SECOND_SIGNAL_GRACE_S + 1.0


def test_a_signal_deferred_by_ray_init_starts_the_deadline_at_once():
    signals, forced = _stopping(grace_s=0.3)
    with pytest.raises(StopRequested), signals:
        with deferred_signals():
            os.kill(os.getpid(), signal.SIGTERM)
            _wait_for(forced, 5)  # still inside the block (ray.init waiting on a dead GCS)
            assert forced, "the deadline did not run while the block deferred the signal"
    assert signals.received == signal.SIGTERM


def test_no_signal_no_deadline():
    signals, forced = _stopping(grace_s=0.05)
    with signals:
        time.sleep(0.3)
    assert forced == [] and STOP_GRACE_S + 1 < LINE_WITHIN_S + 1


PHASES = [
    pytest.param("first_step", id="mid-run"),
    pytest.param("ray_started", id="after-ray-init", marks=pytest.mark.slow),
    pytest.param("workers", id="during-worker-creation", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("at", PHASES)
def test_sigterm_to_the_process_group_is_143_and_one_line_within_10_s(tmp_path, at):
    """``rlcore run`` in a process group of its own, which gets SIGTERM at phase ``at``."""
    stamp = tmp_path / "signalled_at"
    run = interrupted_run(tmp_path, f"{at}:TERM:group", env={SIGNAL_STAMP_ENV: str(stamp)}, own_group=True)
    took = run.ended - float(stamp.read_text())
    assert run.returncode == 143, (run.returncode, run.after)
    assert run.after == ["stopped by SIGTERM: no checkpoint was written yet"], run.after
    assert took < LINE_WITHIN_S, f"{took:.1f} s from the signal to the exit"
    assert not run.left, f"still there after {CLEANUP_BOUND_S}s: {run.left}"
