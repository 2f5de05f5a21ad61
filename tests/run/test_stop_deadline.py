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
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlcore.distributed.startup_signals import SIGNAL_AT_ENV, SIGNAL_STAMP_ENV, deferred_signals
from rlcore.run.stopping import SECOND_SIGNAL_GRACE_S, STOP_GRACE_S, StopOnSignals, StopRequested
from rlcore.testing import leaks

REPO = Path(__file__).resolve().parents[2]
#: The issue's bound: a signal gives its exit code and one line within this long.
LINE_WITHIN_S = 10.0
CLEANUP_BOUND_S = 30.0


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
    with signals, pytest.raises(StopRequested):  # raised when the hold ends
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
    with signals, pytest.raises(StopRequested):
        began = time.monotonic()
        os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C: the user insists
    _wait_for(forced, 5)
    assert forced and forced[0][0] - began < SECOND_SIGNAL_GRACE_S + 1.0


def test_a_signal_deferred_by_ray_init_starts_the_deadline_at_once():
    signals, forced = _stopping(grace_s=0.3)
    with signals:
        with pytest.raises(StopRequested):
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


def _group_signalled_run(tmp_path: Path, at: str) -> tuple[subprocess.CompletedProcess, float, list[str], list]:
    """``rlcore run`` (fsdp1, 1 step) in a process group of its own, which gets SIGTERM at phase ``at``;
    the process, the seconds from the signal to its exit, its lines after the summary, what it left."""
    baseline = leaks.snapshot()
    stamp = tmp_path / "signalled_at"
    env = {
        **os.environ,
        **baseline.env(),
        SIGNAL_AT_ENV: f"{at}:TERM:group",
        SIGNAL_STAMP_ENV: str(stamp),
        "PYTHONUNBUFFERED": "1",
    }
    overrides = [
        f"logger.output_dir={tmp_path / 'out'}",
        "logger.progress_bar=false",
        "logger.tensorboard=false",
        "grpo.max_num_steps=2",
        "policy.backend=fsdp1",
        "policy.generation.backend=fsdp1",
        "cluster.workers_per_node=1",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "rlcore", "run", str(REPO / "examples" / "grpo_tiny.yaml")]
        + [a for o in overrides for a in ("-o", o)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        start_new_session=True,  # its own group: the signal reaches it and what it started, not pytest
        cwd=tmp_path,
    )
    ended = time.time()
    left = leaks.leftovers(baseline, grace_s=CLEANUP_BOUND_S)
    leaks.release(baseline)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    summary = next(i for i, line in enumerate(lines) if line.startswith("rlcore run: "))
    return proc, ended - float(stamp.read_text()), lines[summary + 1 :], left


PHASES = [
    pytest.param("first_step", id="mid-run"),
    pytest.param("ray_started", id="after-ray-init", marks=pytest.mark.slow),
    pytest.param("workers", id="during-worker-creation", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("at", PHASES)
def test_sigterm_to_the_process_group_is_143_and_one_line_within_10_s(tmp_path, at):
    proc, took, after, left = _group_signalled_run(tmp_path, at)
    assert proc.returncode == 143, (proc.returncode, after)
    assert after == ["stopped by SIGTERM: no checkpoint was written yet"], after
    assert took < LINE_WITHIN_S, f"{took:.1f} s from the signal to the exit"
    assert not left, f"still there after {CLEANUP_BOUND_S}s: {left}"
