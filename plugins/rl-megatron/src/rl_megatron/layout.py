"""The ``megatron`` backend's parallel layout: tp, cp and pp from ``policy.megatron_cfg`` (light: no torch).

Registered as the spec's ``layout`` function; rlcore calls it when it resolves
a config, and shards data over the data-parallel ranks that are left. Ranks are
laid out (pp, dp, cp, tp), megatron's ``tp-cp-ep-dp-pp`` order; the worker
checks that megatron placed them so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from rlcore.plugins import LayoutRequest, ParallelLayout

if TYPE_CHECKING:
    from rl_megatron.config import MegatronConfig

_M = "policy.megatron_cfg."


def parallel_layout(request: LayoutRequest) -> ParallelLayout:
    m = cast("MegatronConfig", request.section)  # policy.megatron_cfg, validated with the spec's config_class
    return ParallelLayout(
        tp=m.tensor_model_parallel_size,
        cp=m.context_parallel_size,
        pp=m.pipeline_model_parallel_size,
        paths={
            "tp": _M + "tensor_model_parallel_size",
            "cp": _M + "context_parallel_size",
            "pp": _M + "pipeline_model_parallel_size",
        },
    )
