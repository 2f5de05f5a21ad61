"""Refit by collective broadcast over a group spanning a training rank and the engine ranks.

The group is separate from the training job's default process group (it is
built directly on a ``TCPStore``), so joining it disturbs nothing. Group rank 0
is training rank 0, which packs buckets and broadcasts them; engine ranks
replay the same bucket plan from the metadata and unpack what arrives. Two
buffers alternate so the next bucket is packed while the previous one is on
the wire. gloo on CPU, NCCL on GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Protocol, cast

from rlcore.refit.buckets import (
    LoadFn,
    RefitError,
    RefitMetadata,
    buffer_bytes,
    die_at,
    pack,
    plan_buckets,
    split_layer_names,
    unpack,
)
from rlcore.refit.fingerprint import Fingerprints, SentBytes

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist
    from torch.distributed import Work


#: How long a stream waits for each bucket after the first two: a healthy peer takes the next bucket within
#: the time it loads (or gathers) one, well under a second per 64 MiB here, so a peer that takes longer is hung,
#: and the stream fails instead of waiting out the group's timeout (300 s) with the training ranks behind it in
#: their gathers. The first buckets wait up to the group's timeout: the other side may still be finishing a
#: call before its part of the refit starts. gloo only (a timed-out NCCL op is its watchdog's to handle).
STALL_TIMEOUT_S = 60.0


class BroadcastGroup(Protocol):
    """The refit group as the transports use it (a c10d ``ProcessGroupGloo`` / ``ProcessGroupNCCL``)."""

    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions) -> Work: ...


def init_refit_group(
    ip: str, port: int, world_size: int, rank: int, device: torch.device, timeout_s: float = 300.0
) -> BroadcastGroup:
    """Join the refit group (blocks until all ``world_size`` members have joined).

    ``timeout_s`` bounds the join and every collective of the group: a member that stops taking part makes the
    others' broadcasts fail within it (the backends' default is 30 minutes), so a refit never waits forever.
    """
    import torch.distributed as dist

    from rlcore.training.process_group import tcp_store

    timeout = timedelta(seconds=timeout_s)
    store = tcp_store(ip, port, world_size, rank == 0, timeout)
    # torch's stubs give broadcast to ProcessGroup only
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return cast(BroadcastGroup, dist.ProcessGroupNCCL(store, rank, world_size, options))
    return cast(BroadcastGroup, dist.ProcessGroupGloo(store, rank, world_size, timeout))


def broadcast_weights(
    group: BroadcastGroup,
    tensors: Iterator[tuple[str, torch.Tensor]],
    metadata: RefitMetadata,
    bucket_bytes: int,
    device: torch.device,
    stall_timeout_s: float = STALL_TIMEOUT_S,
) -> SentBytes:
    """Group rank 0: broadcast every tensor of ``metadata``, pulled in order from ``tensors``; returns the
    bytes sent, with the fingerprints of the tensors sent (:class:`rlcore.refit.fingerprint.SentBytes`).

    Buckets after the first two must be taken within ``stall_timeout_s`` (:data:`STALL_TIMEOUT_S`), or a
    :class:`RefitError` says the stream stalled."""
    plan = plan_buckets(metadata, bucket_bytes)
    sent = Fingerprints()
    buffers = _bucket_buffers(buffer_bytes(plan), device)
    pending: list[_Pending | None] = [None, None]
    for index, bucket in enumerate(plan):
        slot = index % 2
        if (previous := pending[slot]) is not None:
            previous.wait(len(plan))
        pack(bucket, tensors, buffers[slot], metadata, sent)
        timeout = stall_timeout_s if index >= 2 else None  # up to two buckets go out before the peers start
        pending[slot] = _Pending.broadcast(group, index, buffers[slot][: bucket.size], device, timeout)
    for work in pending:
        if work is not None:
            work.wait(len(plan))
    return SentBytes(sum(b.size for b in plan), sent.result())


def receive_weights(
    group: BroadcastGroup,
    metadata: RefitMetadata,
    bucket_bytes: int,
    device: torch.device,
    load: LoadFn,
    stall_timeout_s: float = STALL_TIMEOUT_S,
) -> int:
    """Engine ranks: receive every bucket of the plan and ``load`` its tensors in order.

    Two buffers: bucket ``i + 1`` is already on the wire while bucket ``i`` is loaded. Every bucket after the
    first must arrive within ``stall_timeout_s`` (:data:`STALL_TIMEOUT_S`), or a :class:`RefitError` says the
    stream stalled.
    """

    die_at("start")  # test hook (RLCORE_TEST_KILL_ENGINE_AT), nothing when unset
    plan = plan_buckets(metadata, bucket_bytes)
    split = split_layer_names(plan)
    buffers = _bucket_buffers(buffer_bytes(plan), device)
    works = [_Pending.broadcast(group, 0, buffers[0][: plan[0].size], device, None)] if plan else []
    for index, bucket in enumerate(plan):
        works[index].wait(len(plan))
        if index + 1 < len(plan):
            nxt = buffers[(index + 1) % 2][: plan[index + 1].size]
            works.append(_Pending.broadcast(group, index + 1, nxt, device, stall_timeout_s))
        load(unpack(bucket, buffers[index % 2], metadata, copy=split))
    die_at("end")
    return sum(b.size for b in plan)


@dataclass
class _Pending:
    """One bucket's broadcast under way: its index and deadline (None: the group's timeout)."""

    index: int
    work: Work
    timeout_s: float | None

    @classmethod
    def broadcast(
        cls, group: BroadcastGroup, index: int, tensor: torch.Tensor, device: torch.device, timeout_s: float | None
    ) -> _Pending:
        """Broadcast ``tensor`` from group rank 0; on gloo the op fails after ``timeout_s``."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        if timeout_s is not None and device.type != "cuda":
            opts.timeout = timedelta(seconds=timeout_s)
        else:
            timeout_s = None
        return cls(index, group.broadcast([tensor], opts), timeout_s)

    def wait(self, buckets: int) -> None:
        """Wait for the broadcast; a deadline that passed is a :class:`RefitError` in one line."""
        try:
            self.work.wait()
        except RuntimeError as exc:
            if "timed out" not in str(exc).lower():
                raise  # a dead peer: its own error ("Connection reset by peer"), as it was
            deadline = "the refit group's timeout" if self.timeout_s is None else f"{self.timeout_s:.0f}s"
            raise RefitError(
                f"refit stream stalled at bucket {self.index + 1} of {buckets}: a peer of the refit group took no "
                f"part in it within {deadline} (hung, or its process stopped)"
            ) from exc


#: Each process's two bucket buffers, kept across refits on CPU: touching fresh memory costs page
#: faults on every refit, about as much as the copy itself. On a GPU, memory beside a colocated
#: engine is scarcer: new buffers per refit.
_BUFFERS: dict[tuple[int, str], list[torch.Tensor]] = {}


def _bucket_buffers(size: int, device: torch.device) -> list[torch.Tensor]:
    import torch

    if device.type == "cuda":
        return [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(2)]
    key = (size, str(device))
    if key not in _BUFFERS:
        release_buffers()
        _BUFFERS[key] = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(2)]
    return _BUFFERS[key]


def release_buffers() -> None:
    """Free this process's kept bucket buffers (the next refit allocates new ones)."""
    _BUFFERS.clear()
