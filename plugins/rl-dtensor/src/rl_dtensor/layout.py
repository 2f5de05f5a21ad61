"""The ``dtensor`` backend's parallel layout: tp and cp from ``policy.dtensor_cfg`` (light: no torch).

Registered as the spec's ``layout`` function; rlcore calls it when it resolves
a config, and shards data over the data-parallel ranks that are left.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, cast

from rlcore.models.config_json import model_experts
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
    if d.expert_parallel_size > 1:
        raise ValueError(
            f"{_D}expert_parallel_size: is {d.expert_parallel_size}, but the dtensor backend has no expert parallel "
            "(FSDP2 shards the experts over dp); set 1, or use the megatron backend's "
            "policy.megatron_cfg.expert_model_parallel_size"
        )
    check_model(request.policy, d.tensor_parallel_size)
    return ParallelLayout(
        tp=d.tensor_parallel_size,
        cp=d.context_parallel_size,
        paths={"tp": _D + "tensor_parallel_size", "cp": _D + "context_parallel_size"},
    )


def check_model(policy: Any, tp: int) -> None:
    """What the model's config decides before any process starts: tensor parallel over experts (refused,
    :func:`rl_dtensor.parallelize.check_no_experts` says why) and ``policy.hf_config_overrides`` (a key the
    config lacks, or one changing a parameter's shape: refused by :mod:`rlcore.training.hf_config`). A model
    whose config is not on this disk (a directory, or the hub cache) is checked when the workers load it."""
    experts = model_experts(str(policy.model_name))
    if experts is None:
        return
    if tp > 1 and experts > 1:
        raise ValueError(
            f"{_D}tensor_parallel_size: is {tp}, but {policy.model_name} is a mixture-of-experts model "
            f"({experts} experts) and the dtensor backend has no tensor-parallel plan for experts; set "
            f"{_D}tensor_parallel_size=1 (FSDP2 shards the experts over dp), or use the megatron backend"
        )
    if policy.hf_config_overrides and os.path.isdir(str(policy.model_name)):  # a hub id's: when workers load it
        from rlcore.training.hf_config import load_config

        load_config(str(policy.model_name), policy.hf_config_overrides)  # raises ValueError naming the key
