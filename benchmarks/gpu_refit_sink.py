"""The refit receiver of ``benchmarks/gpu.py``: an engine-like target in a Ray actor on the same GPU, the
driver-side facade ``WeightSynchronizer`` refits into, and the timing of a refit against a device copy."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

#: Ray workers import the receiver below as ``gpu_refit_sink:RefitSink`` (gpu.py puts this directory on their
#: PYTHONPATH).
SINK_CLASS = f"{Path(__file__).stem}:RefitSink"


class RefitSink:
    """An engine-like refit target on this process's GPU: one preallocated tensor per weight."""

    def __init__(self) -> None:
        import torch

        from rlcore.refit.shared_memory import ShmReceiver

        self.device = torch.device("cuda", torch.cuda.current_device())
        self.receiver = ShmReceiver()
        self.dest: dict[str, Any] = {}
        self.metadata: dict | None = None

    def endpoint(self) -> tuple[str, bytes]:
        return self.receiver.address, self.receiver.authkey

    def prepare_refit_info(self, metadata: dict) -> None:
        import torch

        from rlcore.refit.buckets import to_dtype

        self.dest = {}
        torch.cuda.empty_cache()
        self.dest = {
            name: torch.empty(tuple(shape), dtype=to_dtype(dtype), device=self.device)
            for name, (shape, dtype) in metadata.items()
        }
        self.metadata = metadata

    def receive(self, bucket_bytes: int) -> int:
        import torch

        def load(named: list) -> None:
            for name, tensor in named:
                self.dest[name].copy_(tensor)

        stats = self.receiver.receive(self.metadata, load, timeout_s=600)
        torch.cuda.synchronize(self.device)
        return stats.tensors

    def payload_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.dest.values())

    def time_copy(self, nbytes: int) -> float:
        """Median seconds of one device-to-device copy of ``nbytes`` (CUDA events)."""
        import torch
        from gpu_refit_transport import device_copy_seconds

        seconds = device_copy_seconds(nbytes, self.device)
        torch.cuda.empty_cache()
        return seconds

    def shutdown(self) -> None:
        self.receiver.close()


class SinkGroup:
    """Driver-side facade with the surface ``WeightSynchronizer`` uses for a colocated engine."""

    def __init__(self, cluster: Any) -> None:
        import ray

        from rlcore.distributed import NamedSharding, RayWorkerGroup

        self.worker_group = RayWorkerGroup(
            cluster, SINK_CLASS, sharding=NamedSharding.for_world(1), name_prefix="bench-refit-sink"
        )
        self.actor = self.worker_group.workers[0]
        self._endpoint = ray.get(self.actor.call.remote("endpoint"))

    def call(self, method: str, *args: Any) -> Any:
        import ray

        return ray.get(self.actor.call.remote(method, *args))

    def prepare_refit_info(self, metadata: dict) -> None:
        self.call("prepare_refit_info", metadata)

    def refit_endpoints(self) -> dict:
        return {0: self._endpoint}

    def update_weights_via_ipc_zmq(self, bucket_bytes: int) -> list:
        return [self.actor.call.remote("receive", bucket_bytes)]

    def refit_world_size(self) -> int:
        return 1

    def shutdown(self) -> None:
        self.worker_group.shutdown()


def time_refit(policy: Any, sink: SinkGroup) -> dict:
    from rlcore.refit import WeightSynchronizer

    sync = WeightSynchronizer(policy, sink, colocated=True)
    sync.sync_weights()  # warm-up: sender buffers, IPC handles
    refit_s = statistics.median([sync.sync_weights()["seconds"] for _ in range(3)])
    nbytes = sink.call("payload_bytes")
    copy_s = sink.call("time_copy", nbytes)
    return {
        "bytes": nbytes,
        "refit_s": refit_s,
        "refit_gb_s": nbytes / refit_s / 1e9,
        "d2d_copy_s": copy_s,
        "d2d_gb_s": nbytes / copy_s / 1e9,
        "ratio": refit_s / copy_s,
    }
