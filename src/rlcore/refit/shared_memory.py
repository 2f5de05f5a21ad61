"""Colocated refit: stream packed buckets to an engine on the same machine.

The engine (receiver) listens on a Unix socket in a private (0700) directory,
authenticated with a random key. The training rank (sender) creates two
shared buffers — POSIX shared memory on CPU, CUDA memory shared by IPC handle
on GPU — and fills one while the receiver loads the other, so two buckets are
in flight. Control messages are small JSON documents; tensors never go through
the socket.

Before any bucket, the sender offers its metadata and the receiver checks it
against what it expects: a missing, extra or mis-shaped tensor is rejected
with nothing applied. A failure mid-stream raises on both sides; the receiver
is then responsible for treating its weights as stale.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import shutil
import tempfile
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener
from typing import TYPE_CHECKING, Any, Callable, Iterator

from rlcore.refit.buckets import RefitError, RefitMetadata, buffer_bytes, check_metadata, pack, plan_buckets, unpack

if TYPE_CHECKING:
    import torch

LoadFn = Callable[[list[tuple[str, "torch.Tensor"]]], None]


def _send(conn: Connection, **message: Any) -> None:
    conn.send_bytes(json.dumps(message).encode())


def _recv(conn: Connection, timeout_s: float) -> dict[str, Any]:
    if not conn.poll(timeout_s):
        raise RefitError(f"refit peer sent nothing for {timeout_s:.0f}s")
    message = json.loads(conn.recv_bytes())
    if message.get("type") == "error":
        raise RefitError(f"refit peer failed: {message['message']}")
    return message


# -- shared buffers ----------------------------------------------------------------------


class _SharedBuffer:
    """A uint8 tensor another process on this machine can map without a copy."""

    def __init__(self, tensor: "torch.Tensor", handle: str, shm: Any = None, owner: bool = False) -> None:
        self.tensor, self.handle, self._shm, self._owner = tensor, handle, shm, owner

    @classmethod
    def create(cls, size: int, device: "torch.device") -> "_SharedBuffer":
        import torch

        if device.type == "cuda":
            tensor = torch.empty(size, dtype=torch.uint8, device=device)
            return cls(tensor, _cuda_ipc_handle(tensor), owner=True)
        from multiprocessing import shared_memory

        shm = shared_memory.SharedMemory(create=True, size=size)
        return cls(torch.frombuffer(shm.buf, dtype=torch.uint8), "shm:" + shm.name, shm, owner=True)

    @classmethod
    def attach(cls, handle: str) -> "_SharedBuffer":
        import torch

        if handle.startswith("cuda:"):
            return cls(_open_cuda_ipc_handle(handle), handle)
        from multiprocessing import resource_tracker, shared_memory

        shm = shared_memory.SharedMemory(name=handle.removeprefix("shm:"))
        # The sender owns and unlinks the segment; keep this process's tracker from unlinking it too.
        resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001
        return cls(torch.frombuffer(shm.buf, dtype=torch.uint8), handle, shm)

    def close(self) -> None:
        self.tensor = None  # the torch view must go before the mapping can close
        if self._shm is not None:
            self._shm.close()
            if self._owner:
                self._shm.unlink()
            self._shm = None


def _cuda_ipc_handle(tensor: "torch.Tensor") -> str:
    """Serialise a CUDA tensor's IPC handle (torch's own reduction) for another process."""
    import base64
    import pickle

    from torch.multiprocessing.reductions import reduce_tensor

    return "cuda:" + base64.b64encode(pickle.dumps(reduce_tensor(tensor))).decode()


def _open_cuda_ipc_handle(handle: str) -> "torch.Tensor":
    # The payload comes from our own sender over an authenticated socket in a 0700 directory.
    import base64
    import pickle

    rebuild, args = pickle.loads(base64.b64decode(handle.removeprefix("cuda:")))  # noqa: S301
    return rebuild(*args)


# -- receiver --------------------------------------------------------------------------------


@dataclass
class ReceiveStats:
    tensors: int
    bytes: int
    buckets: int


class ShmReceiver:
    """The engine side: listens until :meth:`close`; one :meth:`receive` per refit."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="rlcore-refit-")
        os.chmod(self._dir, 0o700)
        self.address = os.path.join(self._dir, "refit.sock")
        self.authkey = secrets.token_bytes(32)
        self._listener = Listener(self.address, family="AF_UNIX", authkey=self.authkey)

    def _accept(self, timeout_s: float) -> Connection:
        # Listener.accept() has no timeout; wait for the socket to be readable first, so a sender
        # that never connects cannot hang the engine forever.
        ready, _, _ = select.select([self._listener._listener._socket], [], [], timeout_s)  # noqa: SLF001
        if not ready:
            raise RefitError(f"no sender connected within {timeout_s:.0f}s")
        return self._listener.accept()

    def receive(self, expected: RefitMetadata, load: LoadFn, timeout_s: float = 600.0) -> ReceiveStats:
        """Accept one sender, check its metadata, and ``load`` every bucket's tensors in order."""
        with self._accept(timeout_s) as conn:
            hello = _recv(conn, timeout_s)
            offered = {k: (tuple(v[0]), v[1]) for k, v in hello["metadata"].items()}
            try:
                check_metadata(expected, offered)
            except RefitError as exc:
                _send(conn, type="error", message=str(exc))
                raise
            plan = plan_buckets(offered, hello["bucket_bytes"])
            buffers = [_SharedBuffer.attach(h) for h in hello["buffers"]]
            _send(conn, type="ready")
            try:
                received = 0
                for index, bucket in enumerate(plan):
                    message = _recv(conn, timeout_s)
                    if message.get("type") != "bucket" or message["index"] != index:
                        raise RefitError(f"expected bucket {index}, got {message}")
                    buffer = buffers[message["buffer"]].tensor
                    if buffer.device.type == "cuda":
                        import torch

                        torch.cuda.current_stream(buffer.device).synchronize()
                    load(unpack(bucket, buffer, offered))
                    received += len(bucket.names)
                    _send(conn, type="free", buffer=message["buffer"])
                if _recv(conn, timeout_s).get("type") != "done" or received != len(expected):
                    raise RefitError(f"stream ended after {received} of {len(expected)} tensors")
                _send(conn, type="ok")
            except Exception as exc:
                try:
                    _send(conn, type="error", message=f"{type(exc).__name__}: {exc}")
                except OSError:
                    pass
                raise
            finally:
                for b in buffers:
                    b.close()
        return ReceiveStats(received, sum(b.size for b in plan), len(plan))

    def close(self) -> None:
        self._listener.close()
        shutil.rmtree(self._dir, ignore_errors=True)


# -- sender ----------------------------------------------------------------------------------


def stream_to_receiver(tensors: Iterator[tuple[str, "torch.Tensor"]], metadata: RefitMetadata, address: str,
                       authkey: bytes, bucket_bytes: int, device: "torch.device",
                       num_buffers: int = 2, timeout_s: float = 600.0) -> int:
    """Send every tensor of ``metadata`` (pulled in order from ``tensors``); returns bytes sent."""
    plan = plan_buckets(metadata, bucket_bytes)
    buffers = _sender_buffers(buffer_bytes(plan), device, num_buffers)
    with Client(address, family="AF_UNIX", authkey=authkey) as conn:
        _send(conn, type="hello", metadata={k: [list(v[0]), v[1]] for k, v in metadata.items()},
              bucket_bytes=bucket_bytes, buffers=[b.handle for b in buffers])
        _recv(conn, timeout_s)  # "ready", or the receiver's rejection raised as RefitError
        free = deque(range(num_buffers))
        for index, bucket in enumerate(plan):
            while not free:
                free.append(_recv(conn, timeout_s)["buffer"])
            slot = free.popleft()
            pack(bucket, tensors, buffers[slot].tensor, metadata)
            if device.type == "cuda":
                import torch

                torch.cuda.current_stream(device).synchronize()
            _send(conn, type="bucket", index=index, buffer=slot)
        while len(free) < num_buffers:
            free.append(_recv(conn, timeout_s)["buffer"])
        _send(conn, type="done")
        if _recv(conn, timeout_s).get("type") != "ok":
            raise RefitError("receiver did not confirm the refit")
    return sum(b.size for b in plan)


#: The sender's buffers, kept across refits: first-touching fresh shared memory costs about as
#: much as filling it, on every refit. Freed (and unlinked) when the size changes or the process exits.
_SENDER_POOL: dict[tuple[int, str, int], list[_SharedBuffer]] = {}


def _sender_buffers(size: int, device: "torch.device", count: int) -> list[_SharedBuffer]:
    key = (size, str(device), count)
    if key not in _SENDER_POOL:
        for old in _SENDER_POOL.values():
            for b in old:
                b.close()
        _SENDER_POOL.clear()
        _SENDER_POOL[key] = [_SharedBuffer.create(size, device) for _ in range(count)]
    return _SENDER_POOL[key]
