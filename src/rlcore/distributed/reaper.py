"""The private Ray cluster's reaper: whatever happens to the driver, its Ray goes with it.

``init_ray`` starts this as a small process of its own session, holding the
read end of a pipe whose write end only the driver has. When the driver exits
— normally, by an exception, or killed with SIGKILL — the pipe reaches EOF and
the reaper stops every process of that Ray instance (:func:`session_pids`),
first with SIGTERM, then SIGKILL after a grace period, and removes the temp
dir. Without it, a killed driver leaves Ray's agents running for a minute and
its temp dir forever.

Usage: ``python -m rlcore.distributed.reaper <temp dir> <driver pid>`` (stdin: the pipe).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from pathlib import Path

#: Environment marker every process of a private Ray instance inherits from the driver.
SESSION_ENV = "RLCORE_RAY_SESSION"
#: Seconds between SIGTERM and SIGKILL.
GRACE_S = 3.0


def session_pids(temp_dir: str, driver: int) -> list[int]:
    """Processes (of this user) of ``temp_dir``'s Ray instance, other than its ``driver``.

    Recognised by the environment marker, or by an open file under ``temp_dir``: Ray's agents are
    started without the driver's environment but keep their log files there.
    """
    marker = f"{SESSION_ENV}={temp_dir}".encode()
    return [
        int(entry.name)
        for entry in Path("/proc").iterdir()
        if entry.name.isdigit() and int(entry.name) not in (os.getpid(), driver) and _belongs(entry, marker, temp_dir)
    ]


def _belongs(proc: Path, marker: bytes, temp_dir: str) -> bool:
    try:
        if marker in (proc / "environ").read_bytes().split(b"\0"):
            return True
        return any(os.readlink(fd).startswith(temp_dir + "/") for fd in (proc / "fd").iterdir())
    except OSError:  # gone, or not ours
        return False


def _signal_all(pids: list[int], sig: int) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, sig)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive


def reap(temp_dir: str, driver: int, grace_s: float = GRACE_S) -> None:
    """Stop every process of the instance (TERM, then KILL after ``grace_s``) and remove its temp dir.

    The driver is spared: after a normal shutdown it is still running, with Ray's log files open.
    """
    alive = _signal_all(session_pids(temp_dir, driver), signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [pid for pid in alive if Path(f"/proc/{pid}").exists() and not _is_zombie(pid)]
    killed = _signal_all(session_pids(temp_dir, driver), signal.SIGKILL)
    deadline = time.monotonic() + grace_s  # a process still dying may write into the dir as it is removed
    while killed and time.monotonic() < deadline:
        time.sleep(0.1)
        killed = [pid for pid in killed if Path(f"/proc/{pid}").exists() and not _is_zombie(pid)]
    for _ in range(10):
        shutil.rmtree(temp_dir, ignore_errors=True)
        if not os.path.exists(temp_dir):
            break
        time.sleep(0.2)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def main() -> None:
    temp_dir, driver = sys.argv[1], int(sys.argv[2])
    sys.stdin.buffer.read()  # returns at EOF: the driver has exited or shut Ray down
    reap(temp_dir, driver)


if __name__ == "__main__":
    main()
