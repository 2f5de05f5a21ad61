"""Settings the dtensor backend refuses, each in one line naming the key and the way out (light: no torch)."""

from __future__ import annotations

from typing import Any


def check_context_parallel(cp: int, device: Any) -> None:
    """Context parallel shards attention across ranks; torch has no CPU implementation of that."""
    if cp <= 1:
        return
    if device.type != "cuda":
        raise ValueError(
            f"policy.dtensor_cfg.context_parallel_size={cp} needs CUDA devices: there is no CPU "
            "attention sharding strategy; set policy.dtensor_cfg.context_parallel_size=1 on CPU"
        )
    raise NotImplementedError(
        f"policy.dtensor_cfg.context_parallel_size={cp}: context parallel is not implemented by the rl-dtensor "
        "backend yet; use tensor_parallel_size with sequence_parallel for long sequences"
    )


def check_vision_settings(hf_config: Any, policy: Any, tp_size: int, model_head: str) -> None:
    """A vision-language model trains with FSDP2 over dp only, padded micro-batches, full weights and an LM head:
    tensor parallel, sequence packing, LoRA and a value head are refused before anything is built."""
    from rlcore.training.vision import check_unsupported

    check_unsupported(
        hf_config,
        {
            "policy.dtensor_cfg.tensor_parallel_size": tp_size > 1,
            "policy.sequence_packing.enabled": policy.sequence_packing.enabled,
            "policy.lora.enabled": policy.lora.enabled,
            "model_head='value' (a value model)": model_head == "value",
        },
    )


def config_check(request: Any) -> list[str]:
    """What the dtensor backend refuses before anything starts (a ``rlcore.plugins.LayoutRequest``): for a
    vision-language model, tensor parallel and LoRA (the workers refuse them too, and a value head)."""
    from rlcore.config.vision import vision_refusals

    policy, section = request.policy, request.section
    tp = section.tensor_parallel_size if section is not None else 1
    return vision_refusals(
        policy,
        "dtensor",
        {
            "policy.dtensor_cfg.tensor_parallel_size": (tp > 1, "set it to 1 (it shards over data parallel ranks)"),
            "policy.lora.enabled": (policy.lora.enabled, "set it to false"),
        },
    )
