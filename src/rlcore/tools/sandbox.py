"""Run one tool call in a child process with limits: wall time, CPU time, memory, no network, bounded output.

A tool is a Python function named ``"module:function"``, called as ``function(**arguments)``. Each call gets a
fresh interpreter (``python -I -S`` running :mod:`rlcore.tools._child`, in a session of its own), which before
importing the tool:

- sets ``RLIMIT_AS`` (``memory_mb`` of address space: an allocation beyond it raises ``MemoryError``) and
  ``RLIMIT_CPU`` (``cpu_s``; past it the kernel kills the process) on itself, inherited by anything it starts;
- blocks network access at the Python level: ``socket.socket`` (and ``_socket.socket``) refuse any family but
  ``AF_UNIX``, and ``create_connection``, ``create_server``, ``fromfd``, ``getaddrinfo`` and ``gethostbyname``
  raise. This stops Python code that uses the socket module (urllib, requests, http.client, asyncio streams); it
  does not stop a C extension, ``ctypes``, or a program the tool starts (``subprocess.run(["curl", ...])``). Where
  unprivileged user namespaces work (``unshare -rn`` succeeds, probed once per process), the child also runs in a
  network namespace of its own (``isolate_network: auto``), which has no interface but a loopback that is down:
  that is the kernel's block, and it covers every way out. ``isolate_network: namespace`` refuses to run a tool
  without one; ``python`` uses the Python-level block alone.

The parent waits ``timeout_s`` of wall time, then kills the child's whole process group. Arguments and results
cross the process boundary as JSON only: the request on the child's stdin, the result on its stdout (the tool's
own prints go to its stderr, of which the last lines are kept for a child that dies without a result). The
result's text (a returned ``str`` as is, anything else as JSON, else ``str()``) is cut to ``max_output_chars``
characters plus a marker saying how many were cut.

The cost is one interpreter start per call (measured by ``tests/tools/test_sandbox.py`` and reported in
docs/tools.md): a process per call keeps one call's state, leaks and limits away from the next.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

#: How a sandboxed tool is kept off the network (see the module's docstring).
NetworkIsolation = Literal["auto", "namespace", "python"]

_CHILD = Path(__file__).with_name("_child.py")


@dataclass(frozen=True)
class ToolResult:
    """What one call gave: ``output`` (the result's text, possibly truncated; '' on failure), ``ok``,
    ``error``: why it failed (timeout, memory limit, CPU limit, blocked network, the tool's exception), or None,
    and ``limit``: which of the call's limits stopped it (``timeout``, ``cpu``, ``memory``, or ``killed`` for a
    signal of unknown cause), None when none did: the tool ran away rather than failed."""

    output: str
    ok: bool
    error: str | None = None
    limit: Literal["timeout", "cpu", "memory", "killed"] | None = None


@dataclass(frozen=True)
class SandboxLimits:
    """The limits of one call. ``cpu_s`` None: the same as ``timeout_s``."""

    timeout_s: float = 10.0
    memory_mb: int = 1024
    cpu_s: float | None = None
    max_output_chars: int = 4000
    isolate_network: NetworkIsolation = "auto"
    extra_sys_path: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s: must be > 0, got {self.timeout_s}")
        if self.memory_mb < 32:
            raise ValueError(f"memory_mb: the child interpreter needs at least 32 MB, got {self.memory_mb}")
        if self.cpu_s is not None and self.cpu_s <= 0:
            raise ValueError(f"cpu_s: must be > 0, got {self.cpu_s}")
        if self.max_output_chars < 1:
            raise ValueError(f"max_output_chars: must be >= 1, got {self.max_output_chars}")


@functools.cache
def network_namespace_available() -> bool:
    """Whether ``unshare -rn`` (a user and a network namespace, no privileges needed) works on this machine."""
    try:
        return subprocess.run(["unshare", "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _command(limits: SandboxLimits) -> list[str]:
    """The child's command line: in a network namespace when ``isolate_network`` asks and the machine allows."""
    python = [sys.executable, "-I", "-S", str(_CHILD)]
    if limits.isolate_network == "python":
        return python
    if network_namespace_available():
        return ["unshare", "-rn", *python]
    if limits.isolate_network == "namespace":
        raise RuntimeError(
            "isolate_network: namespace, but 'unshare -rn' does not work on this machine (unprivileged user "
            "namespaces are off, or util-linux's unshare is missing); use isolate_network: auto to fall back "
            "to the Python-level block"
        )
    return python


def run_tool(target: str, arguments: dict[str, Any], limits: SandboxLimits | None = None) -> ToolResult:
    """Call ``target`` (``"module:function"``) with ``arguments`` in a sandboxed child process; see the module."""
    limits = limits or SandboxLimits()
    request = json.dumps(
        {
            "target": target,
            "arguments": arguments,
            "sys_path": [*limits.extra_sys_path, *(os.path.abspath(p) for p in sys.path)],
            "memory_bytes": limits.memory_mb * 2**20,
            "cpu_s": limits.cpu_s if limits.cpu_s is not None else limits.timeout_s,
            "max_output_chars": limits.max_output_chars,
        }
    )
    with tempfile.TemporaryFile() as stderr:
        child = subprocess.Popen(
            _command(limits),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            start_new_session=True,  # its own process group: a timeout kills whatever it started too
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},  # none of the parent's secrets
        )
        try:
            out, _ = child.communicate(request.encode(), timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(child)
            return ToolResult("", False, f"timeout: killed after {limits.timeout_s:g} s of wall time", "timeout")
        finally:
            _kill_group(child)  # whatever the tool left running in its group
        stderr.seek(0, os.SEEK_END)
        stderr.seek(max(0, stderr.tell() - 500))
        tail = stderr.read().decode("utf-8", "replace").strip()
    return _result(out, child.returncode, limits, tail)


def _kill_group(child: subprocess.Popen[bytes]) -> None:
    """SIGKILL the child's process group and reap the child."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    child.wait()


def _result(out: bytes, returncode: int, limits: SandboxLimits, stderr_tail: str) -> ToolResult:
    """The child's answer, or why it gave none."""
    if out:
        try:
            answer = json.loads(out.decode("utf-8"))
            text = str(answer.get("output", ""))
            if len(text) > limits.max_output_chars + 64:  # the child cuts it; this only guards the parent
                text = text[: limits.max_output_chars]
            memory = answer.get("limit") == "memory"  # the only limit the child itself reports
            return ToolResult(text, bool(answer.get("ok")), answer.get("error"), "memory" if memory else None)
        except (ValueError, AttributeError):
            return ToolResult("", False, "the tool's process wrote a result that is not JSON")
    cpu_s = limits.cpu_s if limits.cpu_s is not None else limits.timeout_s
    if returncode == -signal.SIGXCPU:
        return ToolResult("", False, f"CPU time limit: killed after {cpu_s:g} s of CPU time", "cpu")
    if returncode < 0:  # not by the parent: it kills only after the wait
        name = signal.Signals(-returncode).name
        return ToolResult(
            "",
            False,
            f"killed by {name} (the CPU limit's hard cap, or the kernel's OOM killer): {stderr_tail[-200:]}",
            "killed",
        )
    return ToolResult("", False, f"the tool's process exited with code {returncode} and no result: {stderr_tail}")


__all__ = ["NetworkIsolation", "SandboxLimits", "ToolResult", "network_namespace_available", "run_tool"]
