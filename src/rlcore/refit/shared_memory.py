"""Colocated refit: stream packed buckets to an engine on the same machine.

The engine (receiver) listens on a Unix socket, authenticated with a random
key. The training rank (sender) owns two shared buffers and fills one while
the receiver loads the other, so two buckets are in flight. Control messages
are small JSON documents; tensors never go through the socket.

Nothing here outlives the processes that use it (design.md §2.9), because
workers are killed, not asked, when things go wrong:

- CPU buffers are anonymous memory (``memfd``) whose file descriptors travel
  over the socket (``SCM_RIGHTS``): there is no name in ``/dev/shm`` to leak,
  and the memory is freed when the last process mapping it exits.
- On Linux the socket lives in the abstract namespace: no file, gone with the
  listening process. Elsewhere it is a file in a private (0700) directory.
  Only processes of the same user get past ``accept`` (peer credentials),
  and only those holding the key past the handshake.
- GPU buffers are CUDA memory shared by IPC handle, sent as plain data
  (:mod:`rlcore.refit.cuda_ipc`), never as a pickle.

Before any bucket, the sender offers its metadata and the receiver checks it
against what it expects: a missing, extra or mis-shaped tensor is rejected
with nothing applied. A failure mid-stream raises on both sides; the receiver
is then responsible for treating its weights as stale.
"""

from __future__ import annotations

import json
import mmap
import os
import secrets
import shutil
import socket
import struct
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge
from typing import TYPE_CHECKING, TypeAlias, TypedDict

from rlcore.refit.buckets import (
    LoadFn,
    RefitError,
    RefitMetadata,
    Regions,
    buffer_bytes,
    check_metadata,
    check_regions,
    pack,
    plan_buckets,
    skipped_bytes,
    split_layer_names,
    unpack,
    wait_for_stream,
)
from rlcore.refit.collective import STALL_TIMEOUT_S
from rlcore.refit.fingerprint import Fingerprints, SentBytes

if TYPE_CHECKING:
    import torch


#: The refit socket: raw bytes both ways (JSON messages, then buffers by descriptor or handle).
_Conn: TypeAlias = "Connection[object, object]"


class _Message(TypedDict, total=False):
    """One JSON message between a sender and a receiver: its ``type`` and that type's fields."""

    type: str  # hello (no type), ready, bucket, free, done, ok, error
    message: str  # error
    metadata: dict[str, tuple[list[int], str]]  # hello: the RefitMetadata, shapes as JSON lists
    bucket_bytes: int  # hello
    buffers: list[str]  # hello: each buffer's handle ("fd", or a CUDA IPC handle)
    regions: dict[str, list[int]]  # ready: the receiver's Regions, [dim, start, length] each
    index: int  # bucket
    buffer: int  # bucket, free: which buffer


def _send(conn: _Conn, **message: object) -> None:
    conn.send_bytes(json.dumps(message).encode())


def _recv(conn: _Conn, timeout_s: float) -> _Message:
    if not conn.poll(timeout_s):
        raise RefitError(f"refit peer sent nothing for {timeout_s:.0f}s")
    message: _Message = json.loads(conn.recv_bytes())
    if message.get("type") == "error":
        raise RefitError(f"refit peer failed: {message['message']}")
    return message


def _send_fds(conn: _Conn, fds: list[int]) -> None:
    with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        socket.send_fds(sock, [b"F"], fds)


def _recv_fds(conn: _Conn, count: int, timeout_s: float) -> list[int]:
    if not conn.poll(timeout_s):
        raise RefitError(f"refit peer sent no buffers for {timeout_s:.0f}s")
    with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        _, fds, _, _ = socket.recv_fds(sock, 1, count)
    if len(fds) != count:
        for fd in fds:
            os.close(fd)
        raise RefitError(f"expected {count} buffer descriptors from the sender, got {len(fds)}")
    return fds


# -- shared buffers ----------------------------------------------------------------------


def _anonymous_memory(size: int) -> int:
    """A file descriptor of ``size`` bytes of memory with no name anywhere (freed with its last user)."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("rlcore-refit", os.MFD_CLOEXEC)
    else:  # no memfd (not Linux): a temp file unlinked at once is just as nameless
        fd, path = tempfile.mkstemp(prefix="rlcore-refit-")
        os.unlink(path)
    os.ftruncate(fd, size)
    return fd


class _SharedBuffer:
    """A uint8 tensor another process on this machine can map without a copy.

    CPU: ``fd`` is an anonymous-memory descriptor, sent to the peer with the
    hello; the ``handle`` is then just ``"fd"``. GPU: ``handle`` describes a
    CUDA IPC handle.
    """

    def __init__(
        self, tensor: torch.Tensor, handle: str, mapping: mmap.mmap | None = None, fd: int | None = None
    ) -> None:
        self.tensor, self.handle, self._mapping, self.fd = tensor, handle, mapping, fd

    @classmethod
    def create(cls, size: int, device: torch.device) -> _SharedBuffer:
        import torch

        if device.type == "cuda":
            from rlcore.refit.cuda_ipc import encode_handle

            tensor = torch.empty(size, dtype=torch.uint8, device=device)
            return cls(tensor, encode_handle(tensor))
        fd = _anonymous_memory(size)
        mapping = mmap.mmap(fd, size)
        return cls(torch.frombuffer(mapping, dtype=torch.uint8), "fd", mapping, fd)

    @classmethod
    def attach(cls, handle: str, fd: int | None = None) -> _SharedBuffer:
        """Map the peer's buffer; a descriptor passed in is closed here (the mapping keeps the memory)."""
        import torch

        if handle != "fd":
            from rlcore.refit.cuda_ipc import open_handle

            return cls(open_handle(handle), handle)
        if fd is None:
            raise RefitError("a shared-memory buffer arrived without its descriptor")
        try:
            mapping = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        return cls(torch.frombuffer(mapping, dtype=torch.uint8), handle, mapping)

    def close(self) -> None:
        self.tensor = None  # type: ignore[assignment]  # the torch view must go before the mapping can close
        if self._mapping is not None:
            self._mapping.close()
            self._mapping = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


# -- receiver --------------------------------------------------------------------------------


@dataclass
class ReceiveStats:
    tensors: int
    bytes: int
    buckets: int


def _peer_uid(sock: socket.socket) -> int | None:
    """The connecting process's user id (Linux); None where the platform cannot tell."""
    if not hasattr(socket, "SO_PEERCRED"):
        return None
    _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid


class ShmReceiver:
    """The engine side: listens until :meth:`close`; one :meth:`receive` per refit."""

    def __init__(self) -> None:
        self._dir: str | None = None
        if sys.platform.startswith("linux"):
            self.address = f"\0rlcore-refit-{os.getpid()}-{secrets.token_hex(8)}"
        else:
            self._dir = tempfile.mkdtemp(prefix="rlcore-refit-")
            os.chmod(self._dir, 0o700)
            self.address = os.path.join(self._dir, "refit.sock")
        self.authkey = secrets.token_bytes(32)
        self._mapped: dict[tuple[int, int, int], _SharedBuffer] = {}  # (device, inode, size) -> mapping
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._socket.bind(self.address)
        self._socket.listen(4)

    def _accept(self, timeout_s: float) -> _Conn:
        """The first peer of this user that knows the key; others are dropped. Never waits past the deadline."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            self._socket.settimeout(left)
            try:
                sock, _ = self._socket.accept()
            except TimeoutError:
                break
            if _peer_uid(sock) not in (None, os.getuid()):
                sock.close()
                continue
            sock.setblocking(True)  # the handshake and the stream use the descriptor directly
            conn = Connection(sock.detach())
            try:
                deliver_challenge(conn, self.authkey)
                answer_challenge(conn, self.authkey)
            except (OSError, EOFError, AuthenticationError):
                conn.close()
                continue
            return conn
        raise RefitError(f"no sender connected within {timeout_s:.0f}s")

    def receive(
        self,
        expected: RefitMetadata,
        load: LoadFn,
        timeout_s: float = 600.0,
        stall_timeout_s: float = STALL_TIMEOUT_S,
        regions: Regions | None = None,
    ) -> ReceiveStats:
        """Accept one sender, check its metadata, and ``load`` every bucket's tensors in order. The sender has
        ``timeout_s`` to connect and send its first two buckets (it may still be busy); after that every message
        must come within ``stall_timeout_s``: a sender that stopped fails the refit in a minute, not ten.

        ``regions``: the parts of tensors this receiver reads (a tensor-parallel engine rank's shards); the
        sender then writes only those, and the rest of each such tensor ``load`` gets is not the sender's."""
        with self._accept(timeout_s) as conn:
            hello = _recv(conn, timeout_s)
            offered = {k: (tuple(v[0]), v[1]) for k, v in hello["metadata"].items()}
            try:
                check_metadata(expected, offered)
            except RefitError as exc:
                _send(conn, type="error", message=str(exc))
                raise
            plan = plan_buckets(offered, hello["bucket_bytes"])
            split = split_layer_names(plan)
            _send(conn, type="ready", regions={name: list(region) for name, region in (regions or {}).items()})
            handles = hello["buffers"]
            fds = _recv_fds(conn, handles.count("fd"), timeout_s) if "fd" in handles else []
            buffers = self._attach(handles, fds)
            try:
                received = 0
                for index, bucket in enumerate(plan):
                    # The first buckets may wait for the sender's first gathers; later ones flow or the sender hung.
                    message = _recv(conn, timeout_s if index < 2 else stall_timeout_s)
                    if message.get("type") != "bucket" or message["index"] != index:
                        raise RefitError(f"expected bucket {index}, got {message}")
                    buffer = buffers[message["buffer"]].tensor  # filled: the sender waited before it wrote
                    load(unpack(bucket, buffer, offered, copy=split))
                    wait_for_stream(buffer.device)  # the engine's copies out of the buffer are done
                    received += len(bucket.names)
                    _send(conn, type="free", buffer=message["buffer"])
                if _recv(conn, stall_timeout_s).get("type") != "done" or received != len(expected):
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
                    if b.handle != "fd":  # CUDA buffers are new every refit; CPU mappings are kept
                        b.close()
        return ReceiveStats(received, sum(b.size for b in plan) - skipped_bytes(regions or {}, offered), len(plan))

    def _attach(self, handles: list[str], fds: list[int]) -> list[_SharedBuffer]:
        """The sender's buffers. Its CPU buffers are pooled, so memory mapped at an earlier refit (the
        same memfd) is reused rather than mapped and faulted in again; mappings it no longer sends go."""
        fds_left = iter(fds)
        buffers, kept = [], {}
        for handle in handles:
            if handle != "fd":
                buffers.append(_SharedBuffer.attach(handle))
                continue
            fd = next(fds_left)
            stat = os.fstat(fd)
            key = (stat.st_dev, stat.st_ino, stat.st_size)
            if key in self._mapped:
                os.close(fd)
                kept[key] = self._mapped[key]
            else:
                kept[key] = _SharedBuffer.attach(handle, fd)
            buffers.append(kept[key])
        for key, stale in self._mapped.items():
            if key not in kept:
                stale.close()
        self._mapped = kept
        return buffers

    def close(self) -> None:
        for buffer in self._mapped.values():
            buffer.close()
        self._mapped = {}
        self._socket.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


# -- sender ----------------------------------------------------------------------------------


def stream_to_receiver(
    tensors: Iterator[tuple[str, torch.Tensor]],
    metadata: RefitMetadata,
    address: str,
    authkey: bytes,
    bucket_bytes: int,
    device: torch.device,
    num_buffers: int = 2,
    timeout_s: float = 600.0,
    stall_timeout_s: float = STALL_TIMEOUT_S,
) -> SentBytes:
    """Send every tensor of ``metadata`` (pulled in order from ``tensors``); returns the bytes sent, with the
    fingerprints of the tensors sent (:class:`rlcore.refit.fingerprint.SentBytes`). Of a tensor the receiver
    reads only part of (its ``ready`` names regions: a tensor-parallel engine rank's shards), only that part is
    written and fingerprinted, and the bytes returned leave the rest out. The receiver has
    ``timeout_s`` to answer the hello and free its first buffers (an engine may be finishing a generation first);
    after that each of its answers must come within ``stall_timeout_s``, so a frozen engine fails the refit in
    one line within about a minute."""
    plan = plan_buckets(metadata, bucket_bytes)
    sent = Fingerprints()
    buffers = _sender_buffers(buffer_bytes(plan), device, num_buffers)
    with Client(address, family="AF_UNIX", authkey=authkey) as conn:
        _send(
            conn,
            type="hello",
            metadata={k: [list(v[0]), v[1]] for k, v in metadata.items()},
            bucket_bytes=bucket_bytes,
            buffers=[b.handle for b in buffers],
        )
        ready = _recv(conn, timeout_s)  # or the receiver's rejection raised as RefitError
        regions: Regions = {name: (r[0], r[1], r[2]) for name, r in ready.get("regions", {}).items()}
        check_regions(regions, metadata)
        if fds := [b.fd for b in buffers if b.fd is not None]:
            _send_fds(conn, fds)
        free = deque(range(num_buffers))
        skipped = 0
        for index, bucket in enumerate(plan):
            while not free:  # the engine's first loads may be slow (first touch); later ones flow or it hung
                free.append(_recv(conn, timeout_s if index < num_buffers + 2 else stall_timeout_s)["buffer"])
            slot = free.popleft()
            skipped += pack(bucket, tensors, buffers[slot].tensor, metadata, sent, regions)
            wait_for_stream(device)  # the bucket's copy has landed before the receiver reads it
            _send(conn, type="bucket", index=index, buffer=slot)
        last_wait = timeout_s if len(plan) < num_buffers + 2 else stall_timeout_s  # a short stream: first loads
        while len(free) < num_buffers:
            free.append(_recv(conn, last_wait)["buffer"])
        _send(conn, type="done")
        if _recv(conn, stall_timeout_s).get("type") != "ok":
            raise RefitError("receiver did not confirm the refit")
    return SentBytes(sum(b.size for b in plan) - skipped, sent.result())


#: The sender's CPU buffers, kept across refits: first-touching fresh memory costs about as much as
#: filling it, on every refit. Anonymous, so a killed sender leaks nothing; released early by
#: :func:`release_sender_buffers` (graceful shutdown) or when the size changes.
_SENDER_POOL: dict[tuple[int, str, int], list[_SharedBuffer]] = {}


def _sender_buffers(size: int, device: torch.device, count: int) -> list[_SharedBuffer]:
    if device.type == "cuda":  # GPU memory is scarce beside a colocated engine: new buffers per refit
        release_sender_buffers()
        return [_SharedBuffer.create(size, device) for _ in range(count)]
    key = (size, str(device), count)
    if key not in _SENDER_POOL:
        release_sender_buffers()
        _SENDER_POOL[key] = [_SharedBuffer.create(size, device) for _ in range(count)]
    return _SENDER_POOL[key]


def release_sender_buffers() -> None:
    """Free this process's pooled refit buffers (the next refit allocates new ones)."""
    for buffers in _SENDER_POOL.values():
        for b in buffers:
            b.close()
    _SENDER_POOL.clear()
