"""Shared-memory names a CUDA IPC producer leaves behind when it is killed.

A process that shares CUDA tensors with another process (the colocated refit)
gets two names in ``/dev/shm``: the CUDA driver's ``cuda.shm.<uid>.<pid, hex>.<n>``
and torch's reference counter ``torch_<pid>_<n>_<n>``. Both are removed at a
clean exit, but a Ray worker is killed after its shutdown call, so on a GPU
machine every such worker left them (seen on an H200 by ``make gpu-check``).
The worker removes its own names as the last step of its shutdown; a consumer
that already mapped one keeps its mapping.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SHM = Path("/dev/shm")


def own_names(pid: int, uid: int, names: list[str]) -> list[str]:
    """The entries of ``names`` that are CUDA IPC leftovers of process ``pid`` run by ``uid``."""
    driver = f"cuda.shm.{uid}.{pid:x}."
    counter = f"torch_{pid}_"
    return [n for n in names if n.startswith(driver) or n.startswith(counter)]


def release_own_names(shm: Path = SHM) -> list[str]:
    """Collect this process's shared CUDA blocks and remove its names; nothing if it never used CUDA."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return []
    torch.cuda.ipc_collect()
    try:
        names = own_names(os.getpid(), os.getuid(), os.listdir(shm))
    except OSError:
        return []
    for name in names:
        (shm / name).unlink(missing_ok=True)
    return names
