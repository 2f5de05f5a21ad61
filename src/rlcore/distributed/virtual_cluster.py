"""``RayVirtualCluster``: the devices a run owns, reserved as a Ray placement group.

One bundle per rank (``{"CPU": c}`` on CPU, ``{"CPU": c, "GPU": 1}`` on GPU).
Several worker groups can be colocated on the same bundles (training and
generation sharing devices): each then asks for ``1 / max_colocated_worker_groups``
of a bundle.
"""

from __future__ import annotations

import random
import socket
import time
from dataclasses import dataclass
from typing import Any

from rlcore.distributed.ray_runtime import init_ray, shutdown_ray


class ClusterError(RuntimeError):
    """Resources could not be reserved, or the cluster is unusable."""


@dataclass(frozen=True)
class BundleInfo:
    index: int
    node_ip: str
    local_rank: int
    node_id: str = ""


def _probe_bundle() -> str:
    """Runs inside a bundle: the id of the node it landed on."""
    import ray

    return ray.get_runtime_context().get_node_id()


def _ephemeral_port_floor() -> int:
    """The lowest port the kernel hands out for ``bind(0)``/``connect`` (Linux default 32768)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _free_port(host: str) -> int:
    """Runs on the node that will host a rendezvous: a port nobody listens on now.

    The port is drawn between Ray's worker ports (up to 19999) and the kernel's
    ephemeral range, where no gloo pair or client socket is given a port behind our
    back between this probe and rank 0's bind. Without such a gap, any free port.
    """
    low, high = 20000, _ephemeral_port_floor() - 1
    candidates = random.sample(range(low, high + 1), min(64, high - low + 1)) if high > low else []
    for port in [*candidates, 0]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError(f"no free port on {host}")


class RayVirtualCluster:
    """Reserves ``sum(bundle_ct_per_node_list)`` bundles as one placement group.

    ``placement_group_strategy``: ``"PACK"`` puts bundles on as few nodes as
    possible, ``"SPREAD"`` across nodes. Placement that does not succeed within
    ``placement_timeout_s`` raises :class:`ClusterError` saying what was asked
    and what the cluster has.
    """

    def __init__(
        self,
        bundle_ct_per_node_list: list[int],
        use_gpus: bool = False,
        max_colocated_worker_groups: int = 1,
        num_cpus_per_bundle: float = 1.0,
        name: str = "rlcore",
        placement_group_strategy: str = "PACK",
        placement_timeout_s: float = 60.0,
        ray_address: str | None = None,
    ) -> None:
        if not bundle_ct_per_node_list or any(n < 1 for n in bundle_ct_per_node_list):
            raise ClusterError(f"bundle_ct_per_node_list must hold positive counts, got {bundle_ct_per_node_list}")
        if placement_group_strategy not in ("PACK", "SPREAD"):
            raise ClusterError(f"placement_group_strategy must be PACK or SPREAD, got {placement_group_strategy!r}")
        self.bundle_ct_per_node_list = list(bundle_ct_per_node_list)
        self.use_gpus = use_gpus
        self.max_colocated_worker_groups = max_colocated_worker_groups
        self.num_cpus_per_bundle = num_cpus_per_bundle
        self.name = name
        self.strategy = placement_group_strategy
        self.placement_timeout_s = placement_timeout_s
        self._used_ports: set[tuple[str, int]] = set()
        self._placement_group: Any = None
        self._bundles: list[BundleInfo] = []
        self._owns_ray = init_ray(
            ray_address,
            num_cpus=int(self.world_size * num_cpus_per_bundle + 0.999),
            num_gpus=None,
        )

    @classmethod
    def from_config(cls, cluster_cfg: Any, max_colocated_worker_groups: int = 1, name: str = "rlcore"):
        """Build from a ``ClusterConfig`` (``num_nodes``, ``workers_per_node``, ...)."""
        return cls(
            [cluster_cfg.workers_per_node] * cluster_cfg.num_nodes,
            use_gpus=cluster_cfg.use_gpu,
            max_colocated_worker_groups=max_colocated_worker_groups,
            num_cpus_per_bundle=cluster_cfg.num_cpus_per_worker,
            name=name,
            placement_group_strategy=cluster_cfg.placement_strategy,
            placement_timeout_s=cluster_cfg.placement_timeout_s,
            ray_address=cluster_cfg.ray_address,
        )

    @property
    def world_size(self) -> int:
        return sum(self.bundle_ct_per_node_list)

    @property
    def bundle_resources(self) -> dict[str, float]:
        resources = {"CPU": float(self.num_cpus_per_bundle)}
        if self.use_gpus:
            resources["GPU"] = 1.0
        return resources

    def get_placement_group(self) -> Any:
        """The placement group, created (and waited for) on first use."""
        if self._placement_group is None:
            self._placement_group = self._create_placement_group()
            self._bundles = self._probe_bundles()
        return self._placement_group

    def bundles(self) -> list[BundleInfo]:
        self.get_placement_group()
        return list(self._bundles)

    def actor_resources(self) -> dict[str, float]:
        """What one colocated worker asks for inside its bundle."""
        share = 1.0 / self.max_colocated_worker_groups
        out = {"num_cpus": self.num_cpus_per_bundle * share}
        if self.use_gpus:
            out["num_gpus"] = share
        return out

    def scheduling_strategy(self, bundle_index: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(
            placement_group=self.get_placement_group(),
            placement_group_bundle_index=bundle_index,
            placement_group_capture_child_tasks=True,
        )

    def get_master_address_and_port(self, bundle_index: int = 0) -> tuple[str, int]:
        """A rendezvous address on the node of ``bundle_index``; never the same port twice."""
        import ray

        host = self.bundles()[bundle_index].node_ip
        probe = ray.remote(num_cpus=0)(_free_port).options(scheduling_strategy=self.scheduling_strategy(bundle_index))
        for _ in range(100):
            port = ray.get(probe.remote(host))
            if (host, port) not in self._used_ports:
                self._used_ports.add((host, port))
                return host, port
        raise ClusterError(f"no unused free port found on {host} after 100 tries")

    def _create_placement_group(self) -> Any:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        bundles = [self.bundle_resources for _ in range(self.world_size)]
        pg = placement_group(bundles, strategy=self.strategy, name=f"{self.name}-pg-{time.time_ns()}")
        try:
            ray.get(pg.ready(), timeout=self.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(pg)
            free = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
            total = {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")}
            raise ClusterError(
                f"could not place {len(bundles)} bundles of {self.bundle_resources} ({self.strategy}) "
                f"within {self.placement_timeout_s:.0f}s; the cluster has {free} free of {total} "
                f"(other placement groups hold the rest). Lower cluster.workers_per_node / "
                "cluster.num_cpus_per_worker, shut down other runs, or add nodes."
            ) from None
        return pg

    def _probe_bundles(self) -> list[BundleInfo]:
        import ray

        probe = ray.remote(num_cpus=0)(_probe_bundle)
        results = ray.get(
            [probe.options(scheduling_strategy=self.scheduling_strategy(i)).remote() for i in range(self.world_size)]
        )
        node_ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        per_node: dict[str, int] = {}  # by node id: several nodes may share an address (one machine)
        infos = []
        for index, node_id in enumerate(results):
            infos.append(BundleInfo(index, node_ips[node_id], per_node.get(node_id, 0), node_id))
            per_node[node_id] = per_node.get(node_id, 0) + 1
        return infos

    def shutdown(self) -> bool:
        """Remove the placement group; stop Ray if this cluster started it."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if self._placement_group is not None and ray.is_initialized():
            remove_placement_group(self._placement_group)
        self._placement_group = None
        if self._owns_ray:
            shutdown_ray()
            self._owns_ray = False
        return True
