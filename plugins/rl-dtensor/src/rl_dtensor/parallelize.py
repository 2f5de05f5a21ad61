"""Turn a Hugging Face causal LM into an FSDP2 + DTensor model on a (dp, tp) mesh.

One entry point, :func:`parallelize`, applies three independent steps in the
only order that composes: tensor parallel first (it replaces parameters by
tp-sharded DTensors), activation checkpointing next (it wraps the layers'
forward, not their parameters), FSDP2 last (it shards whatever parameters it
finds, DTensor or not, over dp).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor.parallel import parallelize_module

from rl_dtensor.config import dtensor_section
from rl_dtensor.tp_plans import plan_for, value_model_plan, with_lora
from rlcore.training.worker_base import DTYPES


@dataclass(frozen=True)
class ParallelOptions:
    """What :func:`parallelize` needs from ``policy`` and ``policy.dtensor_cfg``."""

    precision: str = "float32"
    sequence_parallel: bool = False
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    custom_parallel_plan: str | None = None
    reshard_after_forward: bool = True
    value_model: bool = False  # model_head="value": a token-classification head ``score`` instead of ``lm_head``

    @classmethod
    def from_config(cls, cfg, section=None) -> ParallelOptions:
        """From ``policy`` and its ``dtensor_cfg`` (``section``: the validated one, else validated here)."""
        d = dtensor_section(cfg, section)
        return cls(
            precision=cfg.precision,
            sequence_parallel=d.sequence_parallel,
            activation_checkpointing=d.activation_checkpointing,
            cpu_offload=d.cpu_offload,
            custom_parallel_plan=d.custom_parallel_plan,
            reshard_after_forward=d.reshard_after_forward,
        )


def build_mesh(device_type: str, dp: int, tp: int) -> DeviceMesh:
    """The (dp, tp) mesh; ranks are laid out tp-fastest, as rlcore's named sharding expects."""
    return init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", "tp"))


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks: ``model.model.layers`` for HF decoders, else modules named ``*DecoderLayer``."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return list(layers)
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


def vision_units(model: nn.Module) -> list[nn.Module]:
    """A vision-language model's vision blocks, then its whole tower (patch embedding and merger), each its own
    FSDP unit: at most one block is gathered at a time, as for the decoder layers; none for a text model.
    Every rank runs them in every forward (:class:`rlcore.training.vision.VisionForward`)."""
    from rlcore.training.vision import vision_tower_path

    path = vision_tower_path(model)
    if path is None:
        return []
    tower = model.get_submodule(path)
    blocks = next((m for m in tower.modules() if isinstance(m, nn.ModuleList)), nn.ModuleList())
    return [*blocks, tower]


def parallelize(model: nn.Module, mesh: DeviceMesh, opts: ParallelOptions) -> nn.Module:
    """Apply TP (when the tp axis is > 1), activation checkpointing (if asked), then FSDP2 over dp."""
    if mesh["tp"].size() > 1:
        apply_tp(model, mesh["tp"], opts.sequence_parallel, opts.custom_parallel_plan, opts.value_model)
    if opts.activation_checkpointing:
        apply_ac(model)
    apply_fsdp(model, mesh["dp"], opts.precision, opts.cpu_offload, opts.reshard_after_forward)
    return model


def check_tp_divisibility(config, tp: int) -> None:
    """Attention heads and KV heads are split over tp ranks: both must divide evenly."""
    for key in ("num_attention_heads", "num_key_value_heads"):
        n = getattr(config, key, None)
        if n is not None and n % tp:
            raise ValueError(
                f"policy.dtensor_cfg.tensor_parallel_size={tp} does not divide the model's "
                f"{key}={n}; choose a tensor_parallel_size that divides it"
            )


def check_no_experts(model: nn.Module, tp: int) -> None:
    """The built-in plans shard dense MLPs only: a mixture-of-experts model trains with tp 1 (experts sharded by
    FSDP2 over dp) on this backend."""
    from rlcore.training.moe_aux import moe_routers

    if moe_routers(model):
        raise ValueError(
            f"policy.dtensor_cfg.tensor_parallel_size={tp}: {type(model).__name__} is a mixture-of-experts model "
            "and the dtensor backend has no tensor-parallel plan for its experts; set "
            "policy.dtensor_cfg.tensor_parallel_size=1 (FSDP2 shards the experts over dp), or train it with the "
            "megatron backend (tensor and expert parallel)"
        )


def apply_tp(
    model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool, custom_plan: str | None, value_model: bool = False
) -> None:
    """Shard the model over ``tp_mesh`` with the architecture's plan (or the user's); a value model's replicates its
    head instead of sharding ``lm_head`` (:func:`rl_dtensor.tp_plans.value_model_plan`).

    Tied input/output embeddings are re-tied afterwards: both plans shard the
    shared ``[vocab, hidden]`` weight along the vocabulary, so one DTensor can
    serve both modules.
    """
    if custom_plan is None:
        check_tp_divisibility(model.config, tp_mesh.size())
        check_no_experts(model, tp_mesh.size())
    tied = _tied_embeddings(model)
    # The parallel styles replace parameters by new (trainable) ones: frozen weights (LoRA) stay frozen.
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    plan = plan_for(model, sequence_parallel, custom_plan)
    if value_model:  # a plan written for the language model serves its value model too
        plan = value_model_plan(plan, sequence_parallel)
    parallelize_module(model, tp_mesh, with_lora(plan, model))
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
    if tied:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight


def _tied_embeddings(model: nn.Module) -> bool:
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()  # a LoRA-wrapped head has no .weight
    return out is not None and inp is not None and getattr(out, "weight", None) is inp.weight


def apply_ac(model: nn.Module) -> None:
    """Recompute each decoder layer's activations in backward (composable checkpoint: names unchanged)."""
    from torch.distributed._composable import checkpoint

    for layer in decoder_layers(model):
        checkpoint(layer)


def apply_fsdp(
    model: nn.Module, dp_mesh: DeviceMesh, precision: str, cpu_offload: bool, reshard_after_forward: bool = True
) -> None:
    """``fully_shard`` each vision block and the vision tower (:func:`vision_units`), each decoder layer, then the
    root, over ``dp_mesh``.

    Parameters stay float32 (the master weights); ``precision`` only sets the
    compute dtype via ``MixedPrecisionPolicy`` with float32 gradient reduction.
    Gradients are SUMMED over dp (divide factor 1): rlcore's step loop already
    normalises the loss by the global token/sequence counts (design.md §2.3),
    while FSDP's default would average. ``cpu_offload`` keeps parameters,
    gradients and optimizer state on the CPU (no pinned memory without an
    accelerator: ``pin_memory=True`` errors on CPU-only machines).
    ``reshard_after_forward`` false keeps every unit gathered after its forward (the root always is:
    FSDP2's default); the worker then reshards after a step's last backward and after a logprob pass.
    """
    dtype = DTYPES[precision]
    mp = (
        MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        if dtype != torch.float32
        else MixedPrecisionPolicy()
    )
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    reshard = None if reshard_after_forward else False  # None: FSDP2's default (every unit but the root)
    for layer in [*vision_units(model), *decoder_layers(model)]:
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # A plain SUM collective (gloo has no PREMUL_SUM); dividing by 1 afterwards is free.
            module.set_force_sum_reduction_for_comms(True)
