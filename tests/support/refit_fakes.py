"""A recording generation backend for the refit orchestration tests (no engine: it stores what arrives).

Fakes are for the core's orchestration tests only; the real receiver is rl-vllm's.
"""

from __future__ import annotations

from typing import Any

import torch


class RecordingReceiverWorker:
    """Ray-hosted: receives refits through either transport and keeps a copy of every tensor."""

    def __init__(self, rank_in_group: int) -> None:
        from rlcore.refit.shared_memory import ShmReceiver

        self.rank_in_group = rank_in_group
        self.receiver = ShmReceiver()
        self.metadata: dict | None = None
        self.group: Any = None
        self.weights: dict[str, torch.Tensor] = {}

    def endpoint(self) -> tuple[str, bytes]:
        return self.receiver.address, self.receiver.authkey

    def prepare_refit_info(self, metadata: dict) -> None:
        self.metadata = metadata

    def _load(self, named: list[tuple[str, torch.Tensor]]) -> None:
        for name, t in named:
            self.weights[name] = t.clone()

    def receive_shm(self, bucket_bytes: int) -> int:
        return self.receiver.receive(self.metadata, self._load).tensors

    def init_collective(self, ip: str, port: int, world_size: int) -> None:
        from rlcore.refit.collective import init_refit_group

        self.group = init_refit_group(ip, port, world_size, self.rank_in_group, torch.device("cpu"))

    def receive_collective(self, bucket_bytes: int) -> int:
        from rlcore.refit.collective import receive_weights

        return receive_weights(self.group, self.metadata, bucket_bytes, torch.device("cpu"), self._load)

    def received(self) -> dict[str, torch.Tensor]:
        return self.weights


class RecordingGeneration:
    """Driver-side facade over one recording receiver placed on bundle 0 of ``cluster``."""

    def __init__(self, cluster: Any) -> None:
        from rlcore.distributed import NamedSharding, RayWorkerGroup

        self.group = RayWorkerGroup(
            cluster,
            "tests.support.refit_fakes:RecordingReceiverWorker",
            sharding=NamedSharding.for_world(cluster.world_size),
            name_prefix="recorder",
            init_args=(1,),
        )
        self.actor = self.group.workers[0]
        import ray

        self._endpoint = ray.get(self.actor.call.remote("endpoint"))

    def prepare_refit_info(self, metadata: dict) -> None:
        import ray

        ray.get(self.actor.call.remote("prepare_refit_info", metadata))

    def refit_endpoints(self) -> dict[int, tuple[str, bytes]]:
        return {0: self._endpoint}

    def update_weights_via_ipc_zmq(self, bucket_bytes: int) -> list:
        return [self.actor.call.remote("receive_shm", bucket_bytes)]

    def refit_world_size(self) -> int:
        return 1

    def init_collective(self, ip: str, port: int, world_size: int, *, train_world_size: int) -> list:
        return [self.actor.call.remote("init_collective", ip, port, world_size)]

    def update_weights_from_collective(self, bucket_bytes: int) -> list:
        return [self.actor.call.remote("receive_collective", bucket_bytes)]

    def received(self) -> dict:
        import ray

        return ray.get(self.actor.call.remote("received"))

    def shutdown(self) -> None:
        self.group.shutdown()
