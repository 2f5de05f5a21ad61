"""The sandbox's child process: run one tool call and write its result, as JSON, to the parent.

Run as a script (``python -I -S _child.py``), never imported by rlcore: it reads one JSON request from stdin
(``target``, ``arguments``, ``sys_path``, ``memory_bytes``, ``cpu_s``, ``max_output_chars``), sets its own
resource limits and blocks Python-level network access *before* it imports the tool, then calls
``function(**arguments)`` and writes ``{"ok": ..., "output": ..., "error": ...}`` on the stdout it was started
with. The tool's own prints go to stderr. Only the standard library is used here, and nothing is unpickled.
"""

import json
import os
import resource
import sys


def _limit(memory_bytes, cpu_s):
    """The address-space and CPU-time limits of this process (and of whatever it starts)."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    soft = max(1, int(cpu_s + 0.999))  # RLIMIT_CPU counts whole seconds; SIGXCPU at soft, SIGKILL at hard
    resource.setrlimit(resource.RLIMIT_CPU, (soft, soft + 1))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


class NetworkBlocked(PermissionError):
    pass


def _block_network():
    """Replace the socket constructors with ones that refuse any family but AF_UNIX (a Python-level block)."""
    import _socket
    import socket

    def refuse(*args, **kwargs):
        raise NetworkBlocked("network access is blocked in the tool sandbox")

    class GuardedSocket(socket.socket):
        def __init__(self, family=-1, type=-1, proto=-1, fileno=None):
            if fileno is None and family not in (socket.AF_UNIX,):
                refuse()
            super().__init__(family, type, proto, fileno)

    socket.socket = GuardedSocket
    _socket.socket = GuardedSocket
    socket.SocketType = GuardedSocket
    for name in ("create_connection", "create_server", "fromfd", "getaddrinfo", "gethostbyname", "gethostbyname_ex"):
        setattr(socket, name, refuse)
        if hasattr(_socket, name):
            setattr(_socket, name, refuse)


def _text(value, limit):
    """The tool's return value as text (a str as is, else JSON, else ``str``), cut to ``limit`` characters."""
    if isinstance(value, str):
        text = value
    else:
        try:
            text = json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError):
            text = str(value)
    if len(text) > limit:
        text = text[:limit] + f"...[truncated {len(text) - limit} characters]"
    return text


def _run(request):
    sys.path[:0] = [p for p in request["sys_path"] if p not in sys.path]
    module_name, _, function_name = request["target"].partition(":")
    try:
        import importlib

        function = getattr(importlib.import_module(module_name), function_name)
        value = function(**request["arguments"])
        return {"ok": True, "output": _text(value, request["max_output_chars"]), "error": None}
    except MemoryError:
        limit_mb = request["memory_bytes"] // 2**20
        return {
            "ok": False,
            "output": "",
            "error": f"memory limit exceeded ({limit_mb} MB address space)",
            "limit": "memory",
        }
    except NetworkBlocked as exc:
        return {"ok": False, "output": "", "error": f"network blocked: {exc}"}
    except BaseException as exc:  # noqa: BLE001 - the tool's failure is its result
        return {"ok": False, "output": "", "error": _text(f"{type(exc).__name__}: {exc}", 1000)}


def main():
    request = json.loads(sys.stdin.read())
    sys.stdin.close()
    results = os.dup(1)
    os.dup2(2, 1)  # what the tool prints goes to stderr
    _limit(request["memory_bytes"], request["cpu_s"])
    _block_network()
    result = _run(request)
    try:
        payload = json.dumps(result, ensure_ascii=False)
    except MemoryError:
        payload = json.dumps(
            {"ok": False, "output": "", "error": "memory limit exceeded writing the result", "limit": "memory"}
        )
    with os.fdopen(results, "w", encoding="utf-8") as out:
        out.write(payload)


if __name__ == "__main__":
    main()
