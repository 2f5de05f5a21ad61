"""Steps 4-5 of ``make gpu-check``: every ``gpu``-marked test, then ``benchmarks/gpu.py``, each run in
its own process group, streamed to a log and to stdout, and interrupted at its share of the budget."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .common import ROOT, log
from .report import last_json, leak_lines, parse_junit

#: Seconds kept for benchmarks/gpu.py however long the tests take (enough for the 0.5B raw + dtensor rows).
BENCH_MIN_S = 150.0
GPU_MARK = re.compile(r"pytest\.mark\.gpu\b")
RECORD_ENV = "RLCORE_GPU_RECORD"  # tests/support/support_gpu.py appends measured values here


def gpu_test_files(root: Path = ROOT) -> list[Path]:
    """Test files that use the ``gpu`` marker, under ``tests/`` (its package folders, not the fixture plugins)
    and ``plugins/*/tests/``."""
    tests = root / "tests"
    own = [p for p in sorted(tests.glob("**/test_*.py")) if "fixtures" not in p.relative_to(tests).parts]
    candidates = [*own, *sorted(root.glob("plugins/*/tests/test_*.py"))]
    return [p for p in candidates if GPU_MARK.search(p.read_text(encoding="utf-8", errors="replace"))]


def run_streaming(cmd: list[str], logfile: Path, timeout_s: float, env: dict[str, str]) -> tuple[int, bool]:
    """Run ``cmd`` in its own process group, copying its output to ``logfile`` and to stdout as it comes.

    Past ``timeout_s`` the group gets SIGINT (pytest then still writes its report), and SIGKILL 20 s
    later. Returns (exit code, timed out).
    """
    import selectors

    with open(logfile, "wb") as f:
        f.write(f"$ {' '.join(cmd)}\n".encode())
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )
        fd = proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        timed_out = killed = False
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while True:
                now = time.monotonic()
                if not timed_out and now > deadline:
                    timed_out = True
                    f.write(f"\n(gpu-check: time budget of {timeout_s:.0f}s reached: interrupting)\n".encode())
                    _signal_group(proc, signal.SIGINT)
                    deadline = now + 20
                elif timed_out and not killed and now > deadline:
                    killed = True
                    _signal_group(proc, signal.SIGKILL)
                if not sel.select(timeout=1.0):
                    continue
                chunk = os.read(fd, 65536)  # never waits for a whole line: a hung test cannot block the timeout
                if not chunk:
                    break
                f.write(chunk)
                f.flush()
                sys.stdout.write(chunk.decode("utf-8", errors="replace"))
                sys.stdout.flush()
        proc.stdout.close()
        return proc.wait(), timed_out


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run_tests(
    python: str,
    out: Path,
    env: dict[str, str],
    found: dict[str, Any],
    pytest_args: str,
    left: Callable[[], float],
    keep_s: float,
) -> dict[str, Any]:
    """pytest on every file with gpu tests, within ``left()`` less the ``keep_s`` seconds kept for the
    benchmark; the junit report read back, with the exit code and what the leak check found."""
    tests: dict[str, Any] = {"cases": [], "counts": {}}
    files = gpu_test_files()
    records_path = out / "records.jsonl"
    if "error" in found or any(not found.get("imports", {}).get(m, {}).get("ok") for m in ("torch", "pytest")):
        tests["error"] = "not run: torch or pytest cannot be imported"
        return tests
    # The tests take what they need; the benchmark gets the rest, at least BENCH_MIN_S.
    budget = max(60.0, left() - keep_s - 15.0)
    cmd = [
        python,
        "-m",
        "pytest",
        "-m",
        "gpu",
        "-v",
        "-rfEs",
        "-p",
        "no:cacheprovider",
        f"--junitxml={out / 'junit.xml'}",
        "-o",
        "junit_family=xunit1",
    ]
    if found.get("imports", {}).get("pytest_timeout", {}).get("ok"):
        cmd += ["--timeout", str(int(min(180.0, budget)))]
    cmd += [*shlex.split(pytest_args), *(str(f.relative_to(ROOT)) for f in files)]
    log(f"pytest: {len(files)} files with gpu tests, {budget:.0f}s budget")
    code, timed_out = run_streaming(cmd, out / "pytest.log", budget, {**env, RECORD_ENV: str(records_path)})
    tests = parse_junit(out / "junit.xml")
    tests.update(
        exit_code=code,
        timed_out=timed_out,
        files=[str(f.relative_to(ROOT)) for f in files],
        leaks=leak_lines((out / "pytest.log").read_text(encoding="utf-8", errors="replace")),
    )
    if code not in (0, 1) and not timed_out:  # 2 interrupted, 3 internal error, 4 usage error, 5 no tests
        tests["error"] = f"pytest exited {code} (see pytest.log)"
    elif not sum(tests.get("counts", {}).values()):
        tests["error"] = "no test ran (see pytest.log)"
    return tests


def run_benchmark(
    python: str,
    out: Path,
    env: dict[str, str],
    left: Callable[[], float],
    notes: list[str],
    extra_args: list[str] | None = None,
) -> dict[str, Any] | None:
    """benchmarks/gpu.py in the time ``left()``; its JSON result (partial if interrupted), or None when
    too little time is left (said in ``notes``)."""
    budget = left() - 20.0
    if budget < 60:
        notes.append(f"benchmark not run: {max(budget, 0):.0f}s of the budget left")
        return None
    cmd = [python, str(ROOT / "benchmarks" / "gpu.py"), "--budget-s", str(int(budget - 20)), *(extra_args or [])]
    log(f"benchmark: {budget:.0f}s budget")
    code, timed_out = run_streaming(cmd, out / "benchmark.log", budget, env)
    bench = last_json((out / "benchmark.log").read_text(errors="replace"))  # partial if interrupted
    if bench is None or code != 0:
        bench = {"error": f"exit {code}{' (timed out)' if timed_out else ''}; see benchmark.log", **(bench or {})}
    return bench
