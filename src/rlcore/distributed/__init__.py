"""Ray runtime: the virtual cluster, named sharding and worker groups."""

from rlcore.distributed.named_sharding import NamedSharding
from rlcore.distributed.ray_runtime import init_ray, shutdown_ray
from rlcore.distributed.virtual_cluster import ClusterError, RayVirtualCluster
from rlcore.distributed.worker_group import Calls, RayWorkerGroup, Stream, WorkerError, WorkerGroupOwner

__all__ = [
    "Calls",
    "ClusterError",
    "NamedSharding",
    "RayVirtualCluster",
    "RayWorkerGroup",
    "Stream",
    "WorkerError",
    "WorkerGroupOwner",
    "init_ray",
    "shutdown_ray",
]
