"""The leak check judges by ownership (rlcore.testing.leaks): what processes of the tree made is reported
whatever its name; what other programs on the machine make meanwhile is not, whatever its name."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

from rlcore.testing import leaks


def _foreign_env() -> dict[str, str]:
    """The environment of a program outside the tree: no tag, the machine's own temp dir."""
    return {k: v for k, v in os.environ.items() if k not in (leaks.TAG_ENV, "TMPDIR")}


def _python(code: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], env=env)


def test_a_foreign_rlcore_dir_is_not_reported_and_a_pymp_dir_of_ours_is() -> None:
    baseline = leaks.snapshot()
    foreign = Path("/tmp") / f"rlcore-not-ours-{secrets.token_hex(4)}x"
    try:
        assert _python(f"import os; os.mkdir({str(foreign)!r})", _foreign_env()).wait(timeout=60) == 0
        ours = _python("import tempfile; tempfile.mkdtemp(prefix='pymp-')", {**os.environ, **baseline.env()})
        assert ours.wait(timeout=60) == 0
        left = leaks.leftovers(baseline, grace_s=0)
        assert foreign.is_dir() and len(left) == 1, left
        assert re.fullmatch(rf"temp entry {re.escape(baseline.temp_root)}/pymp-\w+", left[0]), left
    finally:
        shutil.rmtree(foreign, ignore_errors=True)
        leaks.release(baseline)
    assert leaks.leftovers(baseline, grace_s=0) == []


def test_a_private_ray_dir_is_ours_when_the_pid_it_names_was_ours() -> None:
    """``rlray-<pid>-*`` dirs live in /tmp (Ray's socket paths must be short): the recorder's pids decide."""
    baseline = leaks.snapshot()
    code = "import os, time; os.mkdir(f'/tmp/rlray-{os.getpid()}-leakcheck'); time.sleep(2.5)"
    ours = _python(code, {**os.environ, **baseline.env()})
    foreign = _python(code, _foreign_env())
    try:
        assert ours.wait(timeout=60) == 0 and foreign.wait(timeout=60) == 0
        assert leaks.leftovers(baseline, grace_s=0) == [f"temp entry /tmp/rlray-{ours.pid}-leakcheck"]
    finally:
        for proc in (ours, foreign):
            shutil.rmtree(f"/tmp/rlray-{proc.pid}-leakcheck", ignore_errors=True)
        leaks.release(baseline)


def test_shared_memory_held_by_another_program_is_not_ours() -> None:
    baseline = leaks.snapshot()
    token = secrets.token_hex(4)
    ours, foreign = Path(f"/dev/shm/leakcheck-ours-{token}x"), Path(f"/dev/shm/leakcheck-foreign-{token}x")
    holder = _python(f"import time; f = open({str(foreign)!r}, 'w'); time.sleep(60)", _foreign_env())
    try:
        made = _python(f"open({str(ours)!r}, 'w').close()", {**os.environ, **baseline.env()})
        assert made.wait(timeout=60) == 0
        for _ in range(100):
            if foreign.exists():
                break
            time.sleep(0.1)
        assert leaks.leftovers(baseline, grace_s=0) == [f"shared memory {ours}"]
    finally:
        holder.kill()
        holder.wait()
        for path in (ours, foreign):
            path.unlink(missing_ok=True)
        leaks.release(baseline)
