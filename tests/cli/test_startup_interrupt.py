"""A signal at any moment of ``rlcore run``'s start-up: exit 130 (SIGINT) / 143 (SIGTERM), one line, nothing left.

Issue 44, item 11: SIGINT half-way through ``ray.init`` crashed the driver with SIGSEGV and left its
``rlray-<pid>-*`` directory. Wall-clock offsets land in different phases on a loaded machine, so each case
sends the signal at a named phase through the test hook ``RLCORE_TEST_SIGNAL_AT``
(:mod:`rlcore.distributed.startup_signals`): the process signals itself when it gets there.

Cost on an idle 2-core machine: the unit cases well under 1 s; each default run case about 15-20 s (stopped
before workers exist); the slow-marked ones (engines, first step) about 30-45 s each.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from rlcore.distributed.startup_signals import SIGNAL_AT_ENV, deferred_signals, signal_self_at
from rlcore.testing import leaks

CLEANUP_BOUND_S = 30.0


def test_a_signal_inside_a_deferred_block_is_raised_after_it_and_after_its_cleanup():
    order = []
    # Python's own SIGINT handler, as rlcore run has it (an earlier test of the session may have set another)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            with deferred_signals(cleanup=lambda: order.append("cleanup")):
                os.kill(os.getpid(), signal.SIGINT)
                order.append("block went on")
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the program's handler is back
    finally:
        signal.signal(signal.SIGINT, before)
    assert order == ["block went on", "cleanup"]


def test_no_signal_no_cleanup_and_the_hook_is_silent_unless_named(monkeypatch):
    called = []
    with deferred_signals(cleanup=lambda: called.append(1)):
        monkeypatch.setenv(SIGNAL_AT_ENV, "workers")
        signal_self_at("ray_start")  # another phase: nothing sent
    assert called == []
    monkeypatch.setenv(SIGNAL_AT_ENV, "ray_start:TERM")
    got = []
    previous = signal.signal(signal.SIGTERM, lambda s, _f: got.append(s))
    try:
        signal_self_at("ray_start")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert got == [signal.SIGTERM]


@dataclass
class Interrupted:
    """What a signalled ``rlcore run`` did: its exit code, its output lines after the summary line, what it
    left behind, and the wall-clock time it exited."""

    returncode: int
    after: list[str]
    left: list[str]
    ended: float


def interrupted_run(
    tmp_path: Path, at: str, *overrides: str, env: dict[str, str] | None = None, own_group: bool = False
) -> Interrupted:
    """Run ``rlcore run`` (fsdp1, 1 step) signalling itself at ``at`` (``RLCORE_TEST_SIGNAL_AT``); ``own_group``
    starts it in a process group of its own, so that a ``:group`` signal reaches it and what it started, not
    pytest."""
    baseline = leaks.snapshot()
    env = {**os.environ, **baseline.env(), SIGNAL_AT_ENV: at, "PYTHONUNBUFFERED": "1", **(env or {})}
    args = [
        sys.executable,
        "-m",
        "rlcore",
        "run",
        "examples/grpo_tiny.yaml",
        "-o",
        f"logger.output_dir={tmp_path / 'out'}",
        "-o",
        "logger.progress_bar=false",
        "-o",
        "logger.tensorboard=false",
        "-o",
        "grpo.max_num_steps=1",
        "-o",
        "policy.backend=fsdp1",
        "-o",
        "policy.generation.backend=fsdp1",
        "-o",
        "cluster.workers_per_node=1",
        *[a for o in overrides for a in ("-o", o)],
    ]
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600, start_new_session=own_group)
    ended = time.time()
    left = leaks.leftovers(baseline, grace_s=CLEANUP_BOUND_S)
    leaks.release(baseline)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    summary = next(i for i, line in enumerate(lines) if line.startswith("rlcore run: "))
    return Interrupted(proc.returncode, lines[summary + 1 :], left, ended)


CASES = [
    pytest.param("ray_start", (), id="sigint-during-ray-start"),  # the crash: inside ray.init, deferred
    pytest.param("workers:TERM", (), id="sigterm-during-worker-creation"),
    pytest.param(
        "engines",
        ("policy.generation.backend=vllm", "policy.backend=dtensor"),
        id="sigint-during-engine-start",
        marks=pytest.mark.slow,
    ),
    pytest.param("first_step", (), id="sigint-during-first-step", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("at", "overrides"), CASES)
def test_a_signal_during_start_up_is_one_line_its_exit_code_and_nothing_left(tmp_path, at, overrides):
    if "vllm" in " ".join(overrides):
        pytest.importorskip("rl_vllm")
    name = "SIGTERM" if at.endswith(":TERM") else "SIGINT"
    run = interrupted_run(tmp_path, at, *overrides)
    assert run.returncode == {"SIGINT": 130, "SIGTERM": 143}[name], run.after
    assert run.after == [f"stopped by {name}: no checkpoint was written yet"], run.after
    assert not run.left, f"still there after {CLEANUP_BOUND_S}s: {run.left}"


def test_a_signal_while_the_run_is_prepared_is_one_line_before_ray(tmp_path):
    """Before the summary line (config, checks, data): not typer's silence or a traceback, one line."""
    env = {**os.environ, SIGNAL_AT_ENV: "prepare:TERM", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlcore",
            "run",
            "examples/grpo_tiny.yaml",
            "-o",
            f"logger.output_dir={tmp_path / 'out'}",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in proc.stderr.splitlines() if not line.startswith(("notice:", "ignored:"))]
    assert (proc.returncode, lines) == (143, ["stopped by SIGTERM before the run started: no checkpoint was written"])
    assert not (tmp_path / "out").exists()
