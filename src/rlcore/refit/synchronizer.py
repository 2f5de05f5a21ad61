"""``WeightSynchronizer``: one ``sync_weights()`` call moves training weights into generation.

It picks the transport from the placement: engines colocated with training
ranks get shared-memory streaming (CUDA IPC on GPU); engines on their own
devices get a collective broadcast. Metadata is exchanged once; the group for
the collective is built once.
"""

from __future__ import annotations

import time
from typing import Any

from rlcore.refit.buckets import RefitError
from rlcore.refit.export import DEFAULT_BUCKET_BYTES


def _wait(refs: list[Any], what: str) -> list[Any]:
    import ray

    try:
        return ray.get(refs)
    except Exception as exc:  # noqa: BLE001 - re-raised with context
        raise RefitError(f"{what} failed: {type(exc).__name__}: {str(exc).strip().splitlines()[0]}") from exc


class WeightSynchronizer:
    """Keeps a generation backend's weights equal to a policy's.

    ``transport``: ``"auto"`` (shared memory when colocated, else collective),
    ``"shared_memory"`` or ``"collective"``. ``cluster`` provides the
    rendezvous address of the collective group.
    """

    def __init__(self, policy: Any, generation: Any, *, colocated: bool, cluster: Any = None,
                 transport: str = "auto", bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        if transport == "auto":
            transport = "shared_memory" if colocated else "collective"
        if transport not in ("shared_memory", "collective"):
            raise ValueError(f"unknown refit transport {transport!r}")
        if transport == "collective" and cluster is None:
            raise ValueError("the collective transport needs the cluster for its rendezvous address")
        self.policy, self.generation, self.cluster = policy, generation, cluster
        self.transport = transport
        self.bucket_bytes = bucket_bytes
        self.metadata: dict[str, Any] | None = None
        self._group_ready = False
        self.stale = True

    def _exchange_metadata(self) -> None:
        if self.metadata is None:
            self.metadata = self.policy.prepare_refit_info()
            self.generation.prepare_refit_info(self.metadata)

    def _init_group(self) -> None:
        if self._group_ready:
            return
        ip, port = self.cluster.get_master_address_and_port()
        world_size = 1 + self.generation.refit_world_size()
        refs = self.policy.init_collective(ip, port, world_size, train_world_size=1)
        refs += self.generation.init_collective(ip, port, world_size, train_world_size=1)
        _wait(refs, "joining the refit group")
        self._group_ready = True

    def sync_weights(self) -> dict[str, float]:
        """Refit now; returns ``{"bytes": ..., "seconds": ...}``. Raises :class:`RefitError` on failure."""
        start = time.perf_counter()
        self.stale = True
        self._exchange_metadata()
        if self.transport == "shared_memory":
            endpoints = self.generation.refit_endpoints()  # before the receivers block their engines
            receivers = self.generation.update_weights_via_ipc_zmq(bucket_bytes=self.bucket_bytes)
            senders = self.policy.stream_weights_via_ipc_zmq(endpoints=endpoints, bucket_bytes=self.bucket_bytes)
        else:
            self._init_group()
            receivers = self.generation.update_weights_from_collective(bucket_bytes=self.bucket_bytes)
            senders = self.policy.broadcast_weights_for_collective(bucket_bytes=self.bucket_bytes)
        sent = _wait(senders, "sending weights")
        _wait(receivers, "receiving weights")
        self.stale = False
        return {"bytes": float(max(sent)), "seconds": time.perf_counter() - start}
