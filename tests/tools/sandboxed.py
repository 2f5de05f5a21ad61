"""Tools the sandbox tests run in a child process (imported there by path: keep this module stdlib-only)."""

from __future__ import annotations

import socket
import time


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def spin() -> None:
    """Loop forever on the CPU."""
    while True:
        pass


def sleep_forever(marker: str) -> None:
    """Sleep past any timeout, with a grandchild (``marker`` on its command line) sleeping too."""
    import subprocess
    import sys

    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", marker])
    time.sleep(300)


def connect_from_subprocess(port: int) -> str:
    """Connect to 127.0.0.1:port from a program the tool starts (outside the tool's interpreter)."""
    import subprocess
    import sys

    code = (
        "import socket, sys\n"
        "try:\n"
        f"    socket.create_connection(('127.0.0.1', {port}), timeout=5).close(); print('connected')\n"
        "except OSError as exc:\n"
        "    print('refused:', exc)\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20).stdout.strip()


def hog_memory() -> int:
    """Allocate without limit."""
    chunks = []
    while True:
        chunks.append(bytearray(64 * 2**20))
        chunks[-1][::4096] = b"x" * len(chunks[-1][::4096])


def connect() -> str:
    """Open a TCP connection."""
    with socket.create_connection(("127.0.0.1", 9), timeout=1):
        return "connected"


def raw_socket() -> str:
    """Create an internet socket directly."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.close()
    return "created"


def long_text(n: int) -> str:
    """A string of n characters."""
    return "x" * n


def structured() -> dict[str, object]:
    """A JSON-serialisable value."""
    return {"answer": 42, "items": [1, 2]}


def fail(message: str) -> None:
    """Raise with message."""
    raise ValueError(message)


def chatty() -> str:
    """Print before returning."""
    print("noise on stdout")
    return "quiet result"
