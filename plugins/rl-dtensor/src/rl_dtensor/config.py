"""The ``dtensor`` backend's own settings, ``policy.dtensor_cfg`` (light: pydantic only, no torch).

:class:`DTensorConfig` is the spec's ``config_class``: rlcore validates the
section with it when it resolves a config, exactly as it validates a third
party's ``<name>_cfg``, and hands the result to the worker as
``backend_config`` and to the layout function as ``LayoutRequest.section``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PositiveInt

from rlcore.config.base import StrictModel

SECTION = "dtensor_cfg"


class DTensorConfig(StrictModel):
    """FSDP2 + DTensor training backend (TP, sequence parallel, CP)."""

    enabled: bool = Field(
        True,
        description="Train with the FSDP2 + DTensor backend ('dtensor'); true unless "
        "written false, so dtensor trains a config that enables no other backend.",
    )
    cpu_offload: bool = Field(False, description="Offload parameters and gradients to CPU (FSDP2 CPUOffloadPolicy).")
    sequence_parallel: bool = Field(False, description="Shard activations along the sequence in TP regions.")
    activation_checkpointing: bool = Field(False, description="Recompute activations in the backward pass.")
    tensor_parallel_size: PositiveInt = Field(1, description="Tensor-parallel degree (tp).")
    context_parallel_size: PositiveInt = Field(1, description="Context-parallel degree (cp); > 1 needs CUDA.")
    expert_parallel_size: PositiveInt = Field(
        1,
        description="Expert-parallel degree; only 1 here (more is refused when the config is resolved): the dtensor "
        "backend shards a mixture-of-experts' experts with FSDP2 over dp like every other weight. Expert "
        "parallel: the megatron backend (policy.megatron_cfg.expert_model_parallel_size).",
    )
    custom_parallel_plan: str | None = Field(
        None, description="'module:object' path of a custom TP plan; None = the built-in plan for the architecture."
    )
    reshard_after_forward: bool = Field(
        False,
        description="Free each layer's gathered parameters after every forward and gather them again for "
        "its backward (FSDP2's default; least memory). false: parameters gathered for a step's first micro-batch "
        "stay gathered (in the compute dtype) through all its micro-batches and are freed after the last backward, "
        "and a logprob pass gathers them once: one all-gather and one dtype cast per layer per step instead of two "
        "per micro-batch, for the memory of the unsharded model. Changes no number.",
    )
    reduce_grads: Literal["per_step", "per_micro_batch"] = Field(
        "per_step",
        description="When FSDP2 reduce-scatters gradients over dp: 'per_step' once, after the step's "
        "last micro-batch (the micro-batches' gradients add up unsharded, in float32, meanwhile: the memory of one "
        "unsharded gradient); 'per_micro_batch' after every backward (sharded gradients only). The sum is the same "
        "up to float32 rounding order.",
    )


def dtensor_section(policy: Any, given: Any = None) -> DTensorConfig:
    """``given`` (the section rlcore validated), else ``policy.dtensor_cfg`` validated here.

    Raises ``rlcore.config.ConfigError`` naming the dotted path of a bad value.
    """
    if given is not None:
        return given
    from rlcore.config import ConfigError, validate_section

    raw = (getattr(policy, "backend_sections", None) or {}).get(SECTION, {})
    section, problems = validate_section(DTensorConfig, raw, f"policy.{SECTION}")
    if section is None:
        raise ConfigError(problems)
    return section


__all__ = ["DTensorConfig", "dtensor_section"]
