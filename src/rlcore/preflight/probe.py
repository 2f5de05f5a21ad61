"""Engine imports, in subprocesses with a time limit per import.

A target is a module (``"torch"``) or ``"module:Attr"``: the attribute is
fetched too, which matters for packages that import lazily (``import engine``
succeeds, ``from engine import Engine`` dies); a backend names such a target
as its ``BackendSpec.import_check``.

An engine's import takes seconds and can crash the interpreter (a package
built against another torch, an illegal instruction), and ``import torch``
on a GPU host loads the driver: none of that may happen in the doctor's own
process. Nothing is started (no Ray, no engine, no network).

The modules are imported one after another in one probe process, so torch and
transformers are loaded once rather than once per engine (on a 2-core box
that halves the doctor's time). Failures stay isolated: a probe process stops
at the first import that raises, crashes or hangs, and that module is tried
again first in a fresh process; only a failure there is reported, and the
modules after it continue in another fresh process. For torch the probe also
reads what it sees of CUDA and whether the kernel grants AMX (what bf16 on an
AMX CPU needs).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Any

_MARKER = "RLCORE_DOCTOR_PROBE "

#: Run as ``python -c _SCRIPT <target>...``: a marked line before and after each import; exits at a failure.
_SCRIPT = f"""
import importlib, json, sys, time
def say(**msg):
    print("\\n{_MARKER}" + json.dumps(msg), flush=True)
for target in sys.argv[1:]:
    say(begin=target)
    start = time.perf_counter()
    name, _, attrs = target.partition(":")
    try:
        module = obj = importlib.import_module(name)
        for attr in filter(None, attrs.split(".")):
            obj = getattr(obj, attr)
        out = dict(target=target, ok=True, seconds=round(time.perf_counter() - start, 2),
                   version=str(getattr(module, "__version__", "") or ""))
        if name == "torch":
            available = module.cuda.is_available()
            count = module.cuda.device_count() if available else 0
            out.update(cuda=module.version.cuda, hip=getattr(module.version, "hip", None),
                       cuda_available=available, device_names=[module.cuda.get_device_name(i) for i in range(count)],
                       cpu_capability=module.backends.cpu.get_cpu_capability(),
                       amx_permission=bool(module.cpu._init_amx()) if hasattr(module.cpu, "_init_amx") else None)
    except BaseException as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        say(target=target, ok=False, error=(type(exc).__name__ + ": " + first)[:400])
        sys.exit(3)
    say(**out)
"""


@dataclass(frozen=True)
class ImportProbe:
    """What importing one target gave.

    ``seconds`` is what this import added in a probe process that had already
    imported the modules probed before it (torch first).
    """

    target: str
    ok: bool
    version: str = ""
    seconds: float | None = None
    error: str = ""
    info: dict[str, Any] = field(default_factory=dict)


def probe_imports(targets: list[str], timeout_s: float = 120.0, python: str = sys.executable) -> dict[str, ImportProbe]:
    """Import ``targets`` in probe processes; a failure is only reported from a fresh interpreter."""
    results: dict[str, ImportProbe] = {}
    pending = list(dict.fromkeys(targets))
    while pending:
        done, failure = _run_group(pending, timeout_s, python)
        results.update((p.target, p) for p in done)
        pending = pending[len(done) :]
        if failure is not None and not done:  # it was first in a fresh interpreter: a real failure
            results[pending[0]] = ImportProbe(pending[0], False, error=failure)
            pending = pending[1:]
    return results


def probe_import(target: str, timeout_s: float = 120.0, python: str = sys.executable) -> ImportProbe:
    return probe_imports([target], timeout_s, python)[target]


def _run_group(targets: list[str], timeout_s: float, python: str) -> tuple[list[ImportProbe], str | None]:
    """The probes of the targets that imported, in order, and the error that stopped the process (if any)."""
    with tempfile.TemporaryFile("w+", errors="replace") as err:
        proc = subprocess.Popen(
            [python, "-c", _SCRIPT, *targets],
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            start_new_session=True,
        )
        lines: queue.Queue[str | None] = queue.Queue()
        pump = threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True)
        pump.start()
        try:
            done, failure = _follow(proc, lines, targets, timeout_s)
        finally:
            pump.join(timeout=5)
            assert proc.stdout is not None
            proc.stdout.close()
        if failure is None and len(done) < len(targets):
            err.seek(0)
            failure = _crash_message(targets[len(done)], proc.returncode, err.read())
        return done, failure


def _follow(
    proc: subprocess.Popen, lines: queue.Queue[str | None], targets: list[str], timeout_s: float
) -> tuple[list[ImportProbe], str | None]:
    """Read a probe's marked lines until it exits, fails, or spends ``timeout_s`` on one import."""
    done: list[ImportProbe] = []
    current = targets[0]
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            _kill_group(proc)
            return done, f"import {current} timed out after {timeout_s:g} s"
        if line is None:
            proc.wait()
            return done, None
        if not line.startswith(_MARKER):
            continue
        msg = json.loads(line[len(_MARKER) :])
        if "begin" in msg:
            current, deadline = msg["begin"], time.monotonic() + timeout_s
        elif msg["ok"]:
            info = {k: v for k, v in msg.items() if k not in ("target", "ok", "version", "seconds")}
            done.append(ImportProbe(msg["target"], True, msg["version"], msg["seconds"], info=info))
        else:
            proc.wait()
            return done, msg["error"]


def _crash_message(target: str, returncode: int, stderr: str) -> str:
    """Why a probe process ended in the middle of importing ``target``."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"import {target} crashed the interpreter ({name})"
    return last_error_line(stderr) or f"import {target} exited with status {returncode}"


def last_error_line(stderr: str) -> str:
    """The exception line of a traceback (``ModuleNotFoundError: ...``), else the last non-empty line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    for line in reversed(lines):
        head = line.split(":", 1)[0]
        if ":" in line and " " not in head and head.split(".")[-1].endswith(("Error", "Exception")):
            return line[:400]
    return lines[-1][:400] if lines else ""


def _pump(stream: IO[str], lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line.rstrip("\n"))
    lines.put(None)


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill a timed-out probe and whatever it started (it runs in its own session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
