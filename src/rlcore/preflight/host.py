"""Checks of the machine itself: Python, shared memory, leftovers, loopback ports.

Each ``check_*`` function takes the facts it judges as arguments (so a test
can hand it a fabricated ``/proc/cpuinfo`` or ``/dev/shm`` listing); the
``read_*`` / ``find_*`` functions next to it gather those facts here.
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from rlcore.preflight.result import CheckResult

GIB = 1024**3
#: Below these, Ray's object store (which lives in /dev/shm) and engines' shared buffers run short.
SHM_MIN_SIZE = 2 * GIB
SHM_MIN_FREE = 1 * GIB
#: Ray's defaults for ``ray start --head`` (GCS) and its dashboard.
RAY_PORTS = {6379: "Ray GCS default", 8265: "Ray dashboard"}
_RLRAY_DIR = re.compile(r"rlray-(\d+)-\w+")


# -- Python and rlcore ----------------------------------------------------------


def check_python(version: tuple[int, int, int], requires: str | None) -> CheckResult:
    """Whether this interpreter satisfies rlcore's ``requires-python``."""
    shown = ".".join(map(str, version))
    details = {"version": shown, "requires_python": requires}
    if not requires:
        return CheckResult("python", "ok", f"Python {shown}", details=details)
    if version_satisfies(version, requires):
        return CheckResult("python", "ok", f"Python {shown} (rlcore requires {requires})", details=details)
    return CheckResult(
        "python",
        "fail",
        f"Python {shown} does not satisfy rlcore's requires-python {requires}",
        f"use a Python {requires} interpreter for the venv",
        details,
    )


def version_satisfies(version: tuple[int, ...], spec: str) -> bool:
    """``(3, 11, 7)`` against ``">=3.10,<4"``: the comparisons requires-python uses (PEP 440, numbers only)."""
    ops: dict[str, Callable[[tuple[int, ...], tuple[int, ...]], bool]] = {
        ">=": lambda a, b: a >= b,
        "<=": lambda a, b: a <= b,
        ">": lambda a, b: a > b,
        "<": lambda a, b: a < b,
        "!=": lambda a, b: a != b,
        "==": lambda a, b: a == b,
    }
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        match = re.fullmatch(r"(>=|<=|!=|==|>|<)\s*(\d+(?:\.\d+)*)(\.\*)?", clause)
        if match is None:
            continue  # ~= and other rare forms: not judged
        op, bound = match.group(1), tuple(int(p) for p in match.group(2).split("."))
        if match.group(3):  # "==3.11.*": a prefix match
            mine = tuple(version[: len(bound)])
        else:
            width = max(len(bound), len(version))
            bound, mine = bound + (0,) * (width - len(bound)), tuple(version) + (0,) * (width - len(version))
        if not ops[op](mine, bound):
            return False
    return True


def check_rlcore(version: str | None, path: str) -> CheckResult:
    """rlcore's own version; without installed metadata no plugin entry point is found."""
    details = {"version": version, "path": path}
    if version is None:
        return CheckResult(
            "rlcore",
            "warn",
            f"rlcore at {path} is not installed: no plugin is discovered",
            "pip install -e .  (in the rlcore checkout)",
            details,
        )
    return CheckResult("rlcore", "ok", f"rlcore {version} at {path}", details=details)


# -- facts a backend's own checks may judge -------------------------------------------


def read_cpuinfo(path: str = "/proc/cpuinfo") -> str:
    """The text of ``/proc/cpuinfo`` (empty where there is none): a fact handed to backends' checks."""
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


# -- shared memory ------------------------------------------------------------------


def check_shm(path: str, size: int | None, free: int | None) -> CheckResult:
    """Size and free space of the shared-memory mount Ray's object store (and engines) use."""
    details = {"path": path, "size_bytes": size, "free_bytes": free}
    if size is None or free is None:
        return CheckResult(
            "shm",
            "warn",
            f"{path} is missing: Ray falls back to a slower disk-backed store",
            "mount a tmpfs on /dev/shm (docker: --shm-size=8g)",
            details,
        )
    message = f"{path} {size / GIB:.1f} GiB, {free / GIB:.1f} GiB free"
    if size < SHM_MIN_SIZE or free < SHM_MIN_FREE:
        return CheckResult(
            "shm",
            "warn",
            f"{message}: Ray's object store and the engines want GBs",
            f"sudo mount -o remount,size=8G {path}  (docker: --shm-size=8g)",
            details,
        )
    return CheckResult("shm", "ok", message, details=details)


def read_shm(path: str = "/dev/shm") -> tuple[int | None, int | None]:
    """(size, free) in bytes of the filesystem at ``path``; (None, None) when there is none."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None, None
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


# -- leftovers of earlier runs --------------------------------------------------------


def check_leftovers(
    shm_names: Iterable[str],
    mapped: set[str],
    temp_dirs: Iterable[str],
    alive: Callable[[int], bool],
    shm_dir: str = "/dev/shm",
) -> CheckResult:
    """``psm_*`` segments no live process maps, and ``rlray-<pid>-*`` dirs whose driver is dead.

    ``shm_names`` are names in ``shm_dir``; ``mapped`` the ones some live
    process has mapped or open; ``temp_dirs`` are paths of ``rlray-*`` dirs.
    """
    segments = sorted(f"{shm_dir}/{n}" for n in shm_names if n.startswith("psm_") and n not in mapped)
    dirs = sorted(d for d in temp_dirs if (m := _RLRAY_DIR.fullmatch(Path(d).name)) and not alive(int(m.group(1))))
    details = {"shm": segments, "temp_dirs": dirs}
    if not segments and not dirs:
        return CheckResult(
            "leftovers", "ok", "no orphaned shared-memory segments or private-Ray temp dirs", details=details
        )
    parts, commands = [], []
    if segments:
        parts.append(f"{len(segments)} orphaned psm_* segment(s)")
        commands.append(f"rm -f {' '.join(segments)}")
    if dirs:
        parts.append(f"{len(dirs)} private-Ray temp dir(s) of dead drivers")
        commands.append(f"rm -rf {' '.join(dirs)}")
    return CheckResult(
        "leftovers", "warn", " and ".join(parts) + " (memory and disk held by dead runs)", "; ".join(commands), details
    )


def find_shm_segments(shm_dir: str = "/dev/shm", min_age_s: float = 300.0) -> list[str]:
    """Names of this user's ``psm_*`` segments untouched for ``min_age_s``.

    A segment just created may not be mapped yet (its creator hands the name
    to a reader); only old ones are candidates for leftovers.
    """
    try:
        entries = list(os.scandir(shm_dir))
    except OSError:
        return []
    uid, cutoff = os.getuid(), time.time() - min_age_s
    return [e.name for e in entries if e.name.startswith("psm_") and _owned_by(e, uid, before=cutoff)]


def find_mapped_shm(shm_dir: str = "/dev/shm", proc: str = "/proc", exclude: Iterable[int] = ()) -> set[str]:
    """Names in ``shm_dir`` that a live process (readable by us, not one of ``exclude``) has mapped or open."""
    prefix = shm_dir.rstrip("/") + "/"
    names: set[str] = set()
    skip = {str(pid) for pid in exclude}
    for pid_dir in Path(proc).glob("[0-9]*"):
        if pid_dir.name in skip:
            continue
        try:
            maps = (pid_dir / "maps").read_text(errors="replace")
        except OSError:
            continue
        names.update(line.split(prefix, 1)[1].split(" ")[0] for line in maps.splitlines() if prefix in line)
        try:
            fds = list((pid_dir / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith(prefix):
                names.add(target[len(prefix) :].split(" ")[0])
    return names


def find_rlray_dirs(root: str = "/tmp") -> list[str]:
    """This user's private-Ray temp dirs (``rlray-<pid>-*``, rlcore's naming)."""
    uid = os.getuid()
    try:
        return [e.path for e in os.scandir(root) if _RLRAY_DIR.fullmatch(e.name) and _owned_by(e, uid)]
    except OSError:
        return []


def _owned_by(entry: os.DirEntry, uid: int, before: float | None = None) -> bool:
    """Whether ``uid`` owns ``entry`` (and it was last modified before ``before``, when given)."""
    try:
        st = entry.stat(follow_symlinks=False)
    except OSError:
        return False
    return st.st_uid == uid and (before is None or st.st_mtime < before)


# -- loopback ports -----------------------------------------------------------------------


def check_ports(loopback_error: str | None, in_use: dict[int, bool]) -> CheckResult:
    """Binding on 127.0.0.1 must work (every private Ray process listens there); Ray's defaults are info."""
    details = {
        "loopback_bind": loopback_error is None,
        "loopback_error": loopback_error,
        "in_use": {str(port): used for port, used in in_use.items()},
    }
    if loopback_error is not None:
        return CheckResult(
            "ports",
            "fail",
            f"cannot bind a port on 127.0.0.1: {loopback_error}",
            "bring up the loopback interface: sudo ip link set lo up",
            details,
        )
    taken = [f"{port} ({RAY_PORTS.get(port, 'port')})" for port, used in in_use.items() if used]
    note = (
        f"; in use: {', '.join(taken)} (fine: rlcore's private Ray picks free ports)"
        if taken
        else f"; {', '.join(map(str, in_use))} free"
    )
    return CheckResult("ports", "ok", "127.0.0.1 binds" + note, details=details)


def try_bind(port: int, host: str = "127.0.0.1") -> str | None:
    """None when ``host:port`` can be bound (nothing is listened on or connected to), else the error."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def ports_in_use(ports: Iterable[int] = RAY_PORTS) -> dict[int, bool]:
    return {port: try_bind(port) is not None for port in ports}
