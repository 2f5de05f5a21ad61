"""The ``dtensor`` backend's parallel layout: tp and cp from ``policy.dtensor_cfg`` (light: no torch).

Registered as the spec's ``layout`` function; rlcore calls it when it resolves
a config, and shards data over the data-parallel ranks that are left.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from rlcore.plugins import LayoutRequest, ParallelLayout

if TYPE_CHECKING:
    from rl_dtensor.config import DTensorConfig

_D = "policy.dtensor_cfg."


def parallel_layout(request: LayoutRequest) -> ParallelLayout:
    d = cast("DTensorConfig", request.section)  # policy.dtensor_cfg, validated with the spec's config_class
    if d.context_parallel_size > 1 and not request.use_gpu:
        raise ValueError(
            f"{_D}context_parallel_size: is {d.context_parallel_size} but cluster.use_gpu is false; "
            f"context parallel needs CUDA (there is no CPU attention sharding): set "
            f"{_D}context_parallel_size=1, or cluster.use_gpu=true on a CUDA machine"
        )
    return ParallelLayout(
        tp=d.tensor_parallel_size,
        cp=d.context_parallel_size,
        paths={"tp": _D + "tensor_parallel_size", "cp": _D + "context_parallel_size"},
    )
