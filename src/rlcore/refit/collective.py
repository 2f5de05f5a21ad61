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
from datetime import timedelta
from typing import TYPE_CHECKING, Protocol, cast

from rlcore.refit.buckets import LoadFn, RefitMetadata, buffer_bytes, pack, plan_buckets, split_layer_names, unpack
from rlcore.refit.fingerprint import Fingerprints, SentBytes

if TYPE_CHECKING:
    import torch
    from torch.distributed import Work


class BroadcastGroup(Protocol):
    """The refit group as the transports use it (a c10d ``ProcessGroupGloo`` / ``ProcessGroupNCCL``)."""

    def broadcast(self, tensor: torch.Tensor, root: int) -> Work: ...


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
) -> SentBytes:
    """Group rank 0: broadcast every tensor of ``metadata``, pulled in order from ``tensors``; returns the
    bytes sent, with the fingerprints of the tensors sent (:class:`rlcore.refit.fingerprint.SentBytes`)."""
    plan = plan_buckets(metadata, bucket_bytes)
    sent = Fingerprints()
    buffers = _bucket_buffers(buffer_bytes(plan), device)
    pending: list[Work | None] = [None, None]
    for index, bucket in enumerate(plan):
        slot = index % 2
        previous = pending[slot]
        if previous is not None:
            previous.wait()
        pack(bucket, tensors, buffers[slot], metadata, sent)
        pending[slot] = group.broadcast(buffers[slot][: bucket.size], 0)
    for work in pending:
        if work is not None:
            work.wait()
    return SentBytes(sum(b.size for b in plan), sent.result())


def receive_weights(
    group: BroadcastGroup, metadata: RefitMetadata, bucket_bytes: int, device: torch.device, load: LoadFn
) -> int:
    """Engine ranks: receive every bucket of the plan and ``load`` its tensors in order.

    Two buffers: bucket ``i + 1`` is already on the wire while bucket ``i`` is loaded.
    """

    plan = plan_buckets(metadata, bucket_bytes)
    split = split_layer_names(plan)
    buffers = _bucket_buffers(buffer_bytes(plan), device)
    works = [group.broadcast(buffers[0][: plan[0].size], 0)] if plan else []
    for index, bucket in enumerate(plan):
        works[index].wait()
        if index + 1 < len(plan):
            nxt = plan[index + 1]
            works.append(group.broadcast(buffers[(index + 1) % 2][: nxt.size], 0))
        load(unpack(bucket, buffers[index % 2], metadata, copy=split))
    return sum(b.size for b in plan)


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
