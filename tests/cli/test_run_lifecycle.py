"""``rlcore run`` as a process: how it stops (signals, errors, SIGKILL) and that it leaves nothing behind.

Each test starts a real run in a subprocess with its own leak tag (every process it starts inherits
it), so "nothing left" is checked for that run alone: no process, no shared-memory segment, no
``rlcore-*`` / ``rlray-*`` temp entry, within a bounded grace period.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlcore.testing import leaks
from tests.algorithms.test_grpo import generation_backend

#: Seconds a stopped or killed run gets to release everything (the figure the issue asks for is printed).
CLEANUP_BOUND_S = 30.0


def run_args(out: Path, *overrides: str) -> list[str]:
    """One training rank and, with rl-vllm, one engine: what these tests stop, kill and reap is one of each
    (on 2 shared cores, half the processes start sooner)."""
    gen = generation_backend()
    train = "reference" if gen == "vllm" else "fsdp1"
    return [
        sys.executable,
        "-m",
        "rlcore",
        "run",
        "examples/grpo_tiny.yaml",
        "-o",
        "cluster.workers_per_node=1",
        "-o",
        f"policy.backend={train}",
        "-o",
        f"policy.generation.backend={gen}",
        "-o",
        f"logger.output_dir={out}",
        "-o",
        "logger.progress_bar=false",
        "-o",
        "logger.tensorboard=false",
        *[a for o in overrides for a in ("-o", o)],
    ]


def start(out: Path, *overrides: str, resume: bool = False) -> tuple[subprocess.Popen, leaks.Baseline]:
    baseline = leaks.snapshot()
    env = {**os.environ, **baseline.env(), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        run_args(out, *overrides) + (["--resume"] if resume else []),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc, baseline


def finish(proc: subprocess.Popen, timeout_s: float) -> tuple[str, str]:
    """``proc.communicate``; a run still going after ``timeout_s`` is killed (its reaper takes Ray and the workers)
    before the test fails, so a slow machine does not also fail the session's leak check."""
    try:
        return proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise


def wait_for_steps(proc: subprocess.Popen, metrics: Path, steps: int, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
            return
        if proc.poll() is not None:
            pytest.fail(f"run ended early with {proc.returncode}: {proc.stderr.read()[-2000:]}")
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"no {steps} steps within {timeout_s}s")


def assert_released(baseline: leaks.Baseline, proc: subprocess.Popen, since: float, what: str) -> float:
    """Nothing of the run is left within the bound (what other runs on the machine leave is not the run's:
    :mod:`rlcore.testing.leaks` judges by ownership); returns the seconds it took."""
    left = leaks.leftovers(baseline, grace_s=CLEANUP_BOUND_S)
    leaks.release(baseline)
    seconds = time.monotonic() - since
    assert not left, f"{what}: still there after {CLEANUP_BOUND_S}s: {left}"
    print(f"{what}: everything released {seconds:.1f}s after it")
    return seconds


def stop_with(proc: subprocess.Popen, baseline: leaks.Baseline, signum: int, code: int) -> int:
    """Send ``signum``: the run exits ``code`` with one line naming a complete checkpoint to resume from, and
    releases everything; returns that checkpoint's step."""
    sent = time.monotonic()
    proc.send_signal(signum)
    _, stderr = finish(proc, 60)
    print(f"{signal.Signals(signum).name}: exit {proc.returncode} {time.monotonic() - sent:.1f}s after the signal")
    assert proc.returncode == code, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"stopped by {signal.Signals(signum).name}: resume from ") and "--resume" in last, last
    assert "Traceback" not in stderr
    assert_released(baseline, proc, sent, signal.Signals(signum).name)
    return json.loads((Path(last.split("resume from ")[1].split()[0]) / "state.json").read_text())["step"]


def test_a_signal_stops_the_run_with_one_line_and_a_resumable_checkpoint(tmp_path):
    """SIGINT here, on fsdp1 ranks that generate themselves (no engines to start: the run is up sooner); SIGTERM
    (exit 143) stops the resumed run of the finished-run test below, with vLLM engines where rl-vllm is installed."""
    proc, baseline = start(
        tmp_path,
        "grpo.max_num_steps=1000",
        "checkpointing.save_every_n_steps=1",
        "policy.backend=fsdp1",
        "policy.generation.backend=fsdp1",
    )
    wait_for_steps(proc, tmp_path / "metrics.jsonl", 2)
    assert stop_with(proc, baseline, signal.SIGINT, 130) >= 1  # a complete checkpoint of a finished step


def test_a_killed_driver_takes_its_ray_and_workers_with_it(tmp_path):
    proc, baseline = start(tmp_path, "grpo.max_num_steps=1000")
    wait_for_steps(proc, tmp_path / "metrics.jsonl", 1)
    assert len(leaks.tagged_processes(baseline.tag)) > 3  # the driver, Ray's daemons, workers, engines
    killed = time.monotonic()
    proc.kill()
    finish(proc, 10)
    seconds = assert_released(baseline, proc, killed, "driver SIGKILL")
    assert seconds < CLEANUP_BOUND_S


def test_a_killed_training_rank_is_one_line_without_ray_s_notice(tmp_path):
    """Ray's "(raylet) A worker died ..." notice goes to stdout from the driver's error listener: a quiet
    run sends it to logs/driver.log with the rest (seen there in every run tried)."""
    proc, baseline = start(tmp_path, "grpo.max_num_steps=1000")
    wait_for_steps(proc, tmp_path / "metrics.jsonl", 1)
    rank = next(
        pid
        for pid in (int(p.split()[0]) for p in leaks.tagged_processes(baseline.tag))
        if re.search(r"/logs/lm_policy-[\w-]*rank0\.log$", _stdout_of(pid))
    )  # a worker's own log
    killed = time.monotonic()
    os.kill(rank, signal.SIGKILL)
    stdout, stderr = finish(proc, 120)
    print(f"rank SIGKILL: exit {proc.returncode} {time.monotonic() - killed:.1f}s after it")
    assert proc.returncode == 1, stderr[-3000:]
    shown = stdout.splitlines() + stderr.splitlines()
    errors = [line for line in shown if line.startswith("error: ")]
    assert len(errors) == 1 and "lm_policy-" in errors[0] and "died" in errors[0], shown
    assert not [line for line in shown if "(raylet)" in line or "Traceback" in line], shown
    assert_released(baseline, proc, killed, "rank SIGKILL")


def _stdout_of(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/fd/1")
    except OSError:
        return ""


def test_an_error_during_the_run_is_one_line_and_releases_everything(tmp_path):
    # A valid argument with a value only torch's optimizer refuses: found when the workers build it.
    proc, baseline = start(tmp_path, "policy.optimizer.kwargs.lr=-1.0")
    _, stderr = finish(proc, 240)
    assert proc.returncode == 1
    lines = stderr.strip().splitlines()
    assert lines[-2].startswith("error: worker lm_policy-") and "Invalid learning rate" in lines[-2], lines[-2:]
    assert "failed to start" in lines[-2]
    log = Path(lines[-1].split("full traceback in ")[1].split(";")[0])
    assert "Traceback" in log.read_text() and "Traceback" not in stderr
    assert_released(baseline, proc, time.monotonic(), "start-up failure")


def test_resume_with_nothing_to_resume_is_an_error(tmp_path):
    out = subprocess.run(run_args(tmp_path) + ["--resume"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        f"--resume: no complete checkpoint in {tmp_path / 'checkpoints'} (checkpointing.enabled=True); "
        "run without --resume to start fresh"
    ]


def test_a_resumed_log_keeps_one_row_per_step(tmp_path):
    from rlcore.run.metrics import keep_steps_before, read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "reward_mean": s / 10}) + "\n" for s in range(5)))
    keep_steps_before(path, 3)  # the checkpoint was of step 2: steps 3 and 4 run again
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2]
    keep_steps_before(path, 0)  # a fresh run
    assert read_metrics(path) == []


def test_a_finished_run_and_its_resume_leave_nothing_and_skip_partial_checkpoints(tmp_path):
    proc, baseline = start(tmp_path, "grpo.max_num_steps=2", "checkpointing.save_every_n_steps=2")
    stdout, stderr = finish(proc, 300)
    assert proc.returncode == 0, stderr[-2000:]
    assert json.loads(stdout.strip().splitlines()[-1])["steps"] == 2
    # Quiet: a few lines of rlcore's own on the terminal; Ray's, the workers' and the engines' output in logs/.
    shown = stderr.splitlines() + stdout.splitlines()
    assert len(shown) < 10 and shown[0].startswith("rlcore run: "), shown
    logs = {p.name: p.read_text(errors="replace") for p in (tmp_path / "logs").iterdir()}
    assert "driver.log" in logs and any(name.startswith("lm_policy-") for name in logs), sorted(logs)
    if generation_backend() == "vllm":
        assert any("vllm" in text.lower() for name, text in logs.items() if name.startswith("vllm-")), sorted(logs)
    assert_released(baseline, proc, time.monotonic(), "normal exit")
    ckpts = tmp_path / "checkpoints"
    _resume_refuses_a_checkpoint_reaching_outside(tmp_path)
    # What a driver killed mid-save leaves: a half-written save, and a newer step without its state.json.
    (ckpts / ".step_000002.tmp-x1y2z3" / "weights").mkdir(parents=True)
    (ckpts / "step_000007" / "weights").mkdir(parents=True)
    # The resumed run goes on until SIGTERM stops it (the signal test's second case, on this run).
    proc, baseline = start(tmp_path, "grpo.max_num_steps=1000", "checkpointing.save_every_n_steps=1", resume=True)
    wait_for_steps(proc, tmp_path / "metrics.jsonl", 4)  # steps 0, 1 kept, 2 and 3 run again from step_000001
    assert stop_with(proc, baseline, signal.SIGTERM, 143) >= 3  # not the forged step_000007: it has no state
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(len(steps))) and len(steps) >= 4, steps  # one row per step, resumed at step 2
    assert not list(ckpts.glob(".step_*.tmp-*"))


def _resume_refuses_a_checkpoint_reaching_outside(run_dir: Path) -> None:
    """A copy of ``run_dir``'s checkpoints with a link out of the newest step: ``--resume`` names the link
    in one line and starts nothing (the check runs on the driver before Ray)."""
    import shutil

    forged = run_dir / "forged"
    shutil.copytree(run_dir / "checkpoints", forged / "checkpoints")
    step = sorted((forged / "checkpoints").glob("step_*"))[-1]
    (run_dir / "elsewhere.safetensors").write_bytes(b"someone else's weights")
    os.symlink(run_dir / "elsewhere.safetensors", step / "weights" / "extra.safetensors")
    proc, baseline = start(forged, resume=True)
    _, stderr = finish(proc, 120)
    assert proc.returncode == 1, stderr[-2000:]
    error = stderr.splitlines()[-1]
    assert error.startswith(
        f"--resume from {step}: {step / 'weights' / 'extra.safetensors'} "
        f"is a link to {run_dir / 'elsewhere.safetensors'}, outside the checkpoint"
    ), stderr
    assert not list((forged / "logs").glob("ray*")) and "Started a local Ray" not in stderr
    assert_released(baseline, proc, time.monotonic(), "refused resume")
    _resume_refuses_a_pickled_call(run_dir)


def _resume_refuses_a_pickled_call(run_dir: Path) -> None:
    """A copy of the newest step whose optimizer state (a ``torch.save`` file) pickles ``os.system``: the
    driver reads it with the workers' restricted reader and refuses in one line before Ray starts; nothing runs."""
    import shutil

    from rlcore.testing.payloads import torch_save_payload

    forged = run_dir / "forged-pickle"
    shutil.copytree(run_dir / "checkpoints", forged / "checkpoints")
    step = sorted((forged / "checkpoints").glob("step_*"))[-1]
    marker = run_dir / "payload-ran"
    (step / "optimizer").write_bytes(torch_save_payload(marker, lambda evil: {"optimizer": evil}))
    began = time.monotonic()
    proc, baseline = start(forged, resume=True)
    _, stderr = finish(proc, 120)
    print(f"refused pickled resume: exit {proc.returncode} after {time.monotonic() - began:.2f}s")
    assert proc.returncode == 1, stderr[-2000:]
    assert stderr.splitlines()[-1:] == [
        f"--resume from {step}: optimizer: refusing to load posix.system (not an "
        "allowed checkpoint type) (checkpoints are data, never code; see "
        f"docs/writing-a-training-backend.md) (or move {step.name} away to resume from the step "
        "before it)"
    ], stderr[-2000:]
    assert not marker.exists() and "Started a local Ray" not in stderr
    assert_released(baseline, proc, time.monotonic(), "refused pickled resume")
