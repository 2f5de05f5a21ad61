"""What a test session (or one run) leaves on the machine, judged by ownership, not by name.

:func:`start` tags this process's environment with a fresh id and gives it a
private temp directory (``TMPDIR``); every process started from here on (Ray's,
the workers', a ``rlcore run`` subprocess's) inherits both. What is ours:

- processes that carry the tag, however they were reparented;
- every entry left in the private temp directory, whatever its name (a
  library's ``pymp-*`` as much as our ``rlcore-*``), except torch.compile's
  cache, which torch keeps there across runs on purpose;
- private-Ray temp dirs (``rlray-<pid>-*``, kept in ``/tmp`` for Ray's short
  socket paths) whose ``<pid>`` was one of our processes; a recorder thread
  notes the pids of tagged processes while the session runs;
- shared-memory entries new since the start, unless a live process outside the
  tree holds them open or their name carries a pid that is not ours.

A stray ``rlcore-*`` directory some other program makes in ``/tmp`` meanwhile is
not ours and is not reported.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

TAG_ENV = "RLCORE_LEAK_TAG"
_SHM = Path("/dev/shm")
_RAY_DIR = re.compile(r"rlray-(\d+)-")  # rlcore.distributed.ray_runtime's naming: the driver's pid
_PID_IN_NAME = re.compile(r"(?:^|[_.-])(\d{2,8})(?=[_.-]|$)")  # torch_<pid>_..., cuda.shm.<pid>...
#: Caches kept in the temp dir across runs on purpose (torch.compile's), like ~/.cache: not leftovers.
_CACHES = re.compile(r"torchinductor_\w+")


@dataclass(frozen=True)
class Baseline:
    tag: str
    temp_root: str  # the private TMPDIR of the processes this baseline answers for
    shm: frozenset[str]
    outer_temp: frozenset[str]
    previous_tmpdir: str | None = None  # what TMPDIR was before :func:`start` replaced it

    def env(self) -> dict[str, str]:
        """What a child process needs in its environment to be counted here."""
        return {TAG_ENV: self.tag, "TMPDIR": self.temp_root}


class _PidRecorder:
    """Notes the pids of tagged processes (a driver's pid names its Ray temp dir long after it exits)."""

    def __init__(self, interval_s: float = 1.0) -> None:
        self.seen: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), name="leak-pid-recorder", daemon=True)
        self._thread.start()

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.record()

    def record(self) -> None:
        for pid, tag in _tagged(all_tags=True):
            self.seen[pid] = tag

    def pids(self, tag: str) -> set[int]:
        self.record()
        return {pid for pid, seen in self.seen.items() if _within(seen, tag)} | {os.getpid()}

    def stop(self) -> None:
        self._stop.set()


_RECORDER: list[_PidRecorder] = []  # started by the first baseline, not at import
_OUTER_TEMP = Path("/tmp")


def _recorder() -> _PidRecorder:
    if not _RECORDER:
        _RECORDER.append(_PidRecorder())
    return _RECORDER[0]


def _within(tag: str, parent: str) -> bool:
    return tag == parent or tag.startswith(parent + "/")


def _shm_entries() -> frozenset[str]:
    return frozenset(p.name for p in _SHM.iterdir()) if _SHM.is_dir() else frozenset()


def _outer_temp_entries() -> frozenset[str]:
    return frozenset(p.name for p in _OUTER_TEMP.iterdir()) if _OUTER_TEMP.is_dir() else frozenset()


def start() -> Baseline:
    """Tag this process and give it a private temp directory; both are inherited by everything it starts
    from now on. Records what exists already. End with :func:`release`."""
    tag = os.environ.setdefault(TAG_ENV, secrets.token_hex(8))
    previous = os.environ.get("TMPDIR")
    root = tempfile.mkdtemp(prefix="rlleak-", dir=_OUTER_TEMP)
    os.environ["TMPDIR"] = root
    tempfile.tempdir = root  # this process's own temp files too
    return _baseline(tag, root, previous)


def snapshot() -> Baseline:
    """A baseline for one child run: a tag under this process's and a temp dir of its own (pass
    :meth:`Baseline.env` to the child)."""
    parent = os.environ.get(TAG_ENV)
    tag = f"{parent}/{secrets.token_hex(4)}" if parent else secrets.token_hex(8)
    return _baseline(tag, tempfile.mkdtemp(prefix="run-"))


def _baseline(tag: str, root: str, previous_tmpdir: str | None = None) -> Baseline:
    _recorder()
    return Baseline(tag, root, _shm_entries(), _outer_temp_entries(), previous_tmpdir)


#: Interpreter helpers that exit with the process that started them (multiprocessing's own).
_ENDS_WITH_PARENT = (b"multiprocessing.resource_tracker", b"multiprocessing.forkserver")


def _tagged(all_tags: bool = False, tag: str = "") -> list[tuple[int, str]]:
    """``(pid, tag)`` of live processes carrying ``tag`` (or one under it; any tag with ``all_tags``)."""
    prefix = f"{TAG_ENV}=".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            values = [v for v in (entry / "environ").read_bytes().split(b"\0") if v.startswith(prefix)]
        except OSError:
            continue
        if values and (all_tags or _within(values[0][len(prefix) :].decode(errors="replace"), tag)):
            found.append((int(entry.name), values[0][len(prefix) :].decode(errors="replace")))
    return found


def tagged_processes(tag: str) -> list[str]:
    """``"pid name"`` of live processes that inherited ``tag`` (or a tag under it).

    Not counted: this process, zombies, and multiprocessing's helpers that are this process's
    children (they exit with it).
    """
    found = []
    for pid, _ in _tagged(tag=tag):
        if pid == os.getpid():
            continue
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]
        helper = int(ppid) == os.getpid() and any(h in cmdline for h in _ENDS_WITH_PARENT)
        if state != "Z" and not helper:
            found.append(f"{pid} {name}")
    return found


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def _our_shm(baseline: Baseline, ours: set[int]) -> list[str]:
    new = set(_shm_entries() - baseline.shm)
    if not new:
        return []
    from rlcore.preflight.host import find_mapped_shm

    foreign = find_mapped_shm(str(_SHM), exclude=ours) & new  # held open by a live process outside the tree
    for name in new - foreign:
        pids = {int(p) for p in _PID_IN_NAME.findall(name)}
        if pids and not pids & ours and any(_alive(p) for p in pids):
            foreign.add(name)  # named after a live process that is not ours
    return sorted(new - foreign)


def _our_temp(baseline: Baseline, ours: set[int]) -> list[str]:
    root = Path(baseline.temp_root)
    found = [str(p) for p in sorted(root.iterdir()) if not _CACHES.fullmatch(p.name)] if root.is_dir() else []
    for name in sorted(_outer_temp_entries() - baseline.outer_temp):
        match = _RAY_DIR.match(name)
        if match and int(match.group(1)) in ours:
            found.append(str(_OUTER_TEMP / name))
    return found


def leftovers(baseline: Baseline, grace_s: float = 15.0) -> list[str]:
    """What processes of ``baseline`` left and is still there after up to ``grace_s`` seconds; empty = clean."""
    deadline = time.monotonic() + grace_s
    while True:
        ours = _recorder().pids(baseline.tag)
        found = [f"shared memory /dev/shm/{n}" for n in _our_shm(baseline, ours)]
        found += [f"temp entry {p}" for p in _our_temp(baseline, ours)]
        found += [f"process {p}" for p in tagged_processes(baseline.tag)]
        if not found or time.monotonic() >= deadline:
            return found
        time.sleep(0.5)


def release(baseline: Baseline) -> None:
    """Remove ``baseline``'s private temp directory (after :func:`leftovers` said what was in it)."""
    shutil.rmtree(baseline.temp_root, ignore_errors=True)
    if os.environ.get("TMPDIR") == baseline.temp_root:  # the session's own: back to what it was
        if baseline.previous_tmpdir is None:
            del os.environ["TMPDIR"]
        else:
            os.environ["TMPDIR"] = baseline.previous_tmpdir
        tempfile.tempdir = None
