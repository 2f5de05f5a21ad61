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


#: What a vision-language model cannot use on this backend, each with its fix (the config check and the workers).
_TP, _LORA = "policy.dtensor_cfg.tensor_parallel_size", "policy.lora.enabled"
_FIXES = {_TP: "set it to 1 (it shards over data parallel ranks)", _LORA: "set it to false"}
_VALUE_HEAD = "model_head='value' (a value model)"


def check_vision_settings(hf_config: Any, policy: Any, tp_size: int, model_head: str) -> None:
    """A vision-language model trains with FSDP2 over dp only, full weights and an LM head: tensor parallel, LoRA
    and a value head are refused before anything is built, in :func:`config_check`'s words."""
    from rlcore.training.vision import check_unsupported

    check_unsupported(
        hf_config,
        {_TP: tp_size > 1, _LORA: policy.lora.enabled, _VALUE_HEAD: model_head == "value"},
        "dtensor",
        {**_FIXES, _VALUE_HEAD: "give the value model a text model"},
    )


def config_check(request: Any) -> list[str]:
    """What the dtensor backend refuses before anything starts (a ``rlcore.plugins.LayoutRequest``): for a
    vision-language model, every setting the workers refuse (tensor parallel, LoRA; a value head is not a config
    key, the workers refuse it)."""
    from rlcore.config.vision import vision_refusals

    policy, section = request.policy, request.section
    tp = section.tensor_parallel_size if section is not None else 1
    on = {_TP: tp > 1, _LORA: policy.lora.enabled}
    return vision_refusals(policy, "dtensor", {key: (on[key], fix) for key, fix in _FIXES.items()})
