"""Build the sharded model without a full copy of it on every rank.

Loading the checkpoint on every rank and sharding afterwards holds the whole
float32 model once per rank (per GPU, on CUDA) before any of it is freed.
Here every rank builds the model's structure with its parameters on the meta
device (no memory), shards it, and allocates only its own shards; rank 0 alone
reads the checkpoint (on CPU) and broadcasts it tensor by tensor, each rank
keeping its part. Buffers (rotary frequencies) are real all along: they are
small and not in the checkpoint.

A value model (``model_head="value"``) is Hugging Face's token-classification
model with one label, loaded by :func:`rlcore.training.value_head.load_value_model`
(a causal-LM checkpoint gets a freshly initialised head).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from rl_dtensor.parallelize import ParallelOptions, parallelize
from rl_dtensor.segment_attention import use_segment_attention
from rlcore.training import lora
from rlcore.training.hf_config import load_config
from rlcore.training.hf_names import pin_conversions
from rlcore.training.value_head import ModelHead, load_value_model, value_model_config
from rlcore.training.vision import freeze_vision_tower, model_class

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device; buffers stay where they are made."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _with_lora(model: nn.Module, lora_cfg: Any) -> list[str]:
    return lora.apply_lora(model, lora_cfg) if lora_cfg.enabled else []


def full_state_on_rank0(
    base_path: str, lora_cfg: Any, adapter_path: str | None, config: PretrainedConfig, model_head: ModelHead = "lm"
) -> dict[str, torch.Tensor]:
    """The model's full float32 state (LoRA applied, the adapter loaded) on rank 0; empty elsewhere."""
    if dist.get_rank() != 0:
        return {}
    if model_head == "value":
        return load_value_model(base_path, config).state_dict()
    model = model_class(config).from_pretrained(base_path, config=config, dtype=torch.float32)
    _with_lora(model, lora_cfg)
    if adapter_path:
        lora.load_adapter_into(model, adapter_path)
    return model.state_dict()


def load_sharded_model(
    base_path: str,
    lora_cfg: Any,
    adapter_path: str | None,
    mesh: Any,
    opts: ParallelOptions,
    device: torch.device,
    config_overrides: Mapping[str, Any] | None = None,
    freeze_vision: bool = False,
) -> tuple[nn.Module, list[str]]:
    """The parallelized model with the checkpoint's weights, and its LoRA targets. Collective.

    ``config_overrides``: ``policy.hf_config_overrides``, set on the config every rank builds from. With
    ``opts.value_model`` it is the value model (Hugging Face's token-classification class, one label). A
    vision-language model is Hugging Face's image-text class; ``freeze_vision`` (``policy.freeze_vision_tower``)
    switches its tower's gradients off before sharding."""
    from transformers import AutoModelForTokenClassification

    model_head: ModelHead = "value" if opts.value_model else "lm"
    config = load_config(base_path, config_overrides)
    if model_head == "value":
        config = value_model_config(config)
    full = full_state_on_rank0(base_path, lora_cfg, adapter_path, config, model_head)
    cls = AutoModelForTokenClassification if model_head == "value" else model_class(config)
    with parameters_on_meta():
        model = cls.from_config(config, dtype=torch.float32)
        targets = _with_lora(model, lora_cfg)
    if freeze_vision:
        freeze_vision_tower(model)
    pin_conversions(model)  # the checkpoint's names, looked up by class name: before FSDP2 renames the class
    use_segment_attention(model)  # packed rows attend per sequence, not through a [T, T] mask
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    parallelize(model, mesh, opts)
    model.to_empty(device="cpu" if opts.cpu_offload else device)
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return model, targets
