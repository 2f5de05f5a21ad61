"""Malicious pickles for checkpoint tests: each would create ``marker`` if anything unpickled it.

A backend's tests plant these in a real checkpoint, in every file a resume
reads, and check that loading refuses them and that the marker never appears
(design.md §2.8). ``PICKLE_PAYLOADS`` maps a case name to its builder and the
global the refusal should name.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _text(value: str) -> bytes:
    """A SHORT_BINUNICODE opcode holding ``value``."""
    data = value.encode()
    return b"\x8c" + bytes([len(data)]) + data


def system_payload(marker: Path) -> bytes:
    """Protocol 0: ``os.system(cmd)`` by GLOBAL."""
    return b"cos\nsystem\n(V" + f"touch {marker}".encode() + b"\ntR."


def getattr_payload(marker: Path) -> bytes:
    """``getattr(<the os that torch.distributed.checkpoint.filesystem imports>, "system")(cmd)``."""
    return (
        b"\x80\x02cbuiltins\ngetattr\nctorch.distributed.checkpoint.filesystem\nos\n"
        + _text("system")
        + b"\x86R"
        + _text(f"touch {marker}")
        + b"\x85R."
    )


def dotted_payload(marker: Path) -> bytes:
    """Protocol 4 resolves dotted names: ``torch.distributed.checkpoint.filesystem`` + ``os.system``."""
    return (
        b"\x80\x04"
        + _text("torch.distributed.checkpoint.filesystem")
        + _text("os.system")
        + b"\x93"
        + _text(f"touch {marker}")
        + b"\x85R."
    )


class RunsCommand:
    """Pickles as ``os.system(cmd)``: what a forged ``torch.save`` file holds."""

    def __init__(self, cmd: str) -> None:
        self.cmd = cmd

    def __reduce__(self) -> tuple:
        return os.system, (self.cmd,)


def torch_save_payload(marker: Path, wrap: Callable[[Any], Any] = lambda evil: evil) -> bytes:
    """A ``torch.save`` file whose object (optionally wrapped, e.g. in a dict) runs a command when loaded."""
    import torch

    buf = io.BytesIO()
    torch.save(wrap(RunsCommand(f"touch {marker}")), buf)
    return buf.getvalue()


PICKLE_PAYLOADS: dict[str, tuple[Callable[[Path], bytes], str]] = {
    "os.system": (system_payload, "os.system"),
    "getattr-chain": (getattr_payload, "builtins.getattr"),
    "protocol-4-dotted": (dotted_payload, "torch.distributed.checkpoint.filesystem.os.system"),
}
