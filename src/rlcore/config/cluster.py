"""Where the workers run: nodes, ranks per node and the Ray cluster to use."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt

from rlcore.config.base import StrictModel


class ClusterConfig(StrictModel):
    """The virtual cluster the training workers are placed on."""

    num_nodes: PositiveInt = Field(1, description="Number of nodes.")
    workers_per_node: PositiveInt = Field(
        2, description="Training ranks per node (one per GPU in GPU mode, i.e. 'gpus_per_node')."
    )
    use_gpu: bool = Field(
        False, description="Place one CUDA device per worker. False runs every rank on CPU with gloo."
    )
    num_cpus_per_worker: float = Field(1.0, ge=0, description="Ray CPUs reserved per worker (fractions allowed).")
    ray_address: str | None = Field(
        None,
        description="Ray cluster to attach to (e.g. 'ray://host:10001' or 'auto'). "
        "None starts a private local Ray instance bound to loopback.",
    )
    placement_strategy: Literal["PACK", "SPREAD"] = Field(
        "PACK", description="Ray placement-group strategy for the worker bundles."
    )
    placement_timeout_s: PositiveFloat = Field(
        60.0, description="Seconds to wait for the placement group before giving up with an error."
    )

    @property
    def world_size(self) -> int:
        """Total number of training ranks: ``num_nodes * workers_per_node``."""
        return self.num_nodes * self.workers_per_node
