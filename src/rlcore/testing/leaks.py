"""What a test session (or one run) leaves on the machine: shared memory, temp dirs, processes.

:func:`start` tags this process's environment with a fresh id; every process
started from here on — Ray's, the workers', a ``rlcore run`` subprocess's —
inherits the tag, so :func:`leftovers` can find the ones still alive however
they were reparented. Shared-memory segments and ``rlcore-*`` / ``rlray-*``
temp entries are compared with what existed at :func:`start`.
"""

from __future__ import annotations

import os
import secrets
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

TAG_ENV = "RLCORE_LEAK_TAG"
_TEMP_PREFIXES = ("rlcore-", "rlray-")


@dataclass(frozen=True)
class Baseline:
    tag: str
    shm: frozenset[str]
    temp: frozenset[str]


def _temp_roots() -> set[Path]:
    return {Path("/tmp"), Path(tempfile.gettempdir())}


def _shm_entries() -> frozenset[str]:
    shm = Path("/dev/shm")
    return frozenset(p.name for p in shm.iterdir()) if shm.is_dir() else frozenset()


def _temp_entries() -> frozenset[str]:
    return frozenset(str(p) for root in _temp_roots() if root.is_dir()
                     for p in root.iterdir() if p.name.startswith(_TEMP_PREFIXES))


def start() -> Baseline:
    """Tag this process (and everything it starts from now on) and record what exists already."""
    return snapshot(os.environ.setdefault(TAG_ENV, secrets.token_hex(8)))


def snapshot(tag: str | None = None) -> Baseline:
    """Record what exists now, for processes tagged ``tag`` (a new tag: put it in a child's ``TAG_ENV``)."""
    return Baseline(tag or secrets.token_hex(8), _shm_entries(), _temp_entries())


#: Interpreter helpers that exit with the process that started them (multiprocessing's own).
_ENDS_WITH_PARENT = (b"multiprocessing.resource_tracker", b"multiprocessing.forkserver")


def tagged_processes(tag: str) -> list[str]:
    """``"pid name"`` of live processes that inherited ``tag``.

    Not counted: this process, zombies, and multiprocessing's helpers that are this process's
    children (they exit with it).
    """
    marker = f"{TAG_ENV}={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
        helper = int(ppid) == os.getpid() and any(h in cmdline for h in _ENDS_WITH_PARENT)
        if state != "Z" and not helper:
            found.append(f"{entry.name} {name}")
    return found


def leftovers(baseline: Baseline, grace_s: float = 15.0) -> list[str]:
    """What appeared since ``baseline`` and is still there after up to ``grace_s`` seconds; empty = clean."""
    deadline = time.monotonic() + grace_s
    while True:
        found = [f"shared memory /dev/shm/{n}" for n in sorted(_shm_entries() - baseline.shm)]
        found += [f"temp entry {p}" for p in sorted(_temp_entries() - baseline.temp)]
        found += [f"process {p}" for p in tagged_processes(baseline.tag)]
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(0.5)
