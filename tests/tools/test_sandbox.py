"""The tool sandbox: results as JSON text, truncation, exceptions, and each limit stopping the tool it is for
(wall time, CPU time, memory, network), with nothing left running after a call."""

from __future__ import annotations

import os
import socket
import time
import uuid
from pathlib import Path

import pytest

from rlcore.tools.sandbox import SandboxLimits, network_namespace_available, run_tool

TOOLS = "tests.tools.sandboxed"
FAST = SandboxLimits(timeout_s=5.0, memory_mb=256, max_output_chars=20)


def processes_with(marker: str) -> list[int]:
    """The pids whose command line holds ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_results_come_back_as_text_cut_to_the_limit():
    run = run_tool(f"{TOOLS}:add", {"a": 2, "b": 3}, FAST)
    assert (run.output, run.ok, run.error) == ("5", True, None)  # a non-str result is JSON
    assert run_tool(f"{TOOLS}:structured", {}, SandboxLimits(max_output_chars=100)).output == (
        '{"answer": 42, "items": [1, 2]}'
    )
    cut = run_tool(f"{TOOLS}:long_text", {"n": 50}, FAST)
    assert cut.ok and cut.output == "x" * 20 + "...[truncated 30 characters]"
    assert run_tool(f"{TOOLS}:chatty", {}, FAST).output == "quiet result"  # what the tool prints is not its result
    failed = run_tool(f"{TOOLS}:fail", {"message": "boom"}, FAST)
    assert (failed.ok, failed.output, failed.error, failed.limit) == (False, "", "ValueError: boom", None)
    wrong = run_tool(f"{TOOLS}:add", {"a": 1}, FAST)
    assert not wrong.ok and "TypeError" in wrong.error and "'b'" in wrong.error


def test_a_tool_past_its_wall_time_is_killed_with_what_it_started():
    marker = f"rlcore-sandbox-test-{uuid.uuid4().hex}"
    started = time.monotonic()
    result = run_tool(f"{TOOLS}:sleep_forever", {"marker": marker}, SandboxLimits(timeout_s=0.5))
    took = time.monotonic() - started
    assert (result.ok, result.error, result.limit) == (False, "timeout: killed after 0.5 s of wall time", "timeout")
    assert took < 0.5 + 1.5, took  # the limit, plus slack for a loaded machine
    assert processes_with(marker) == []  # its grandchild went with it


def test_a_busy_loop_is_stopped_by_the_cpu_limit():
    started = time.monotonic()
    result = run_tool(f"{TOOLS}:spin", {}, SandboxLimits(timeout_s=30, cpu_s=1))
    assert (result.ok, result.error, result.limit) == (False, "CPU time limit: killed after 1 s of CPU time", "cpu")
    assert time.monotonic() - started < 30


def test_an_allocation_past_the_memory_limit_fails():
    result = run_tool(f"{TOOLS}:hog_memory", {}, SandboxLimits(timeout_s=20, memory_mb=256))
    assert (result.ok, result.error, result.limit) == (False, "memory limit exceeded (256 MB address space)", "memory")


@pytest.mark.parametrize("tool", ["connect", "raw_socket"])
def test_python_code_cannot_open_a_socket(tool):
    result = run_tool(f"{TOOLS}:{tool}", {}, SandboxLimits(isolate_network="python"))
    assert (result.ok, result.error) == (False, "network blocked: network access is blocked in the tool sandbox")


def test_a_program_the_tool_starts_is_kept_off_the_network_only_by_the_namespace():
    """The Python-level block stops the tool's own interpreter, not a program it starts; the network namespace
    stops that too. A listener on this machine's loopback is the target."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        python_only = run_tool(
            f"{TOOLS}:connect_from_subprocess", {"port": port}, SandboxLimits(isolate_network="python")
        )
        assert python_only.output == "connected"  # what docs/tools.md says the Python-level block does not stop
        if not network_namespace_available():
            pytest.skip("unprivileged network namespaces ('unshare -rn') do not work on this machine")
        isolated = run_tool(f"{TOOLS}:connect_from_subprocess", {"port": port}, SandboxLimits(isolate_network="auto"))
        assert isolated.ok and isolated.output.startswith("refused: "), isolated


def test_no_process_outlives_its_call():
    children_before = _children(os.getpid())
    for tool in ("add", "spin"):
        run_tool(f"{TOOLS}:{tool}", {"a": 1, "b": 2} if tool == "add" else {}, SandboxLimits(timeout_s=0.3))
    assert _children(os.getpid()) == children_before


def _children(pid: int) -> set[int]:
    kids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                kids.add(int(entry.name))
    return kids


def test_limits_refuse_nonsense():
    with pytest.raises(ValueError, match="timeout_s"):
        SandboxLimits(timeout_s=0)
    with pytest.raises(ValueError, match="memory_mb"):
        SandboxLimits(memory_mb=8)
