"""The ``megatron`` backend's own settings, ``policy.megatron_cfg``, and the checks of a policy config that it
cannot run, by what it implements and where it runs. Light module: pydantic only, no torch, no megatron.

:class:`MegatronConfig` is the spec's ``config_class``: rlcore validates the
section with it when it resolves a config, as it does a third party's
``<name>_cfg``, with the policy as the validation context's ``owner`` (so
``optimizer.lr`` and ``pipeline_dtype`` left null follow the policy). The rules
below say which valid settings cannot run *here*: features that need
TransformerEngine kernels or CUDA tensors, settings that would change the
meaning of a training step, and torch optimizer settings megatron never reads.
Each problem names the dotted path, the value and the fix, like every rlcore
config error. rlcore runs :func:`config_check` (the spec's ``config_check``)
when it resolves a config, before anything starts; the worker runs
:func:`megatron_config_problems` again on its own machine, where it knows
whether TransformerEngine is installed.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, PositiveInt, ValidationInfo, model_validator

from rlcore.config.base import StrictModel, derived, fill_derived
from rlcore.config.policy import Precision
from rlcore.models.config_json import model_experts

SECTION = "megatron_cfg"
_M = f"policy.{SECTION}."


class MegatronOptimizerConfig(StrictModel):
    """megatron-core optimizer settings."""

    optimizer: Literal["adam", "sgd"] = Field("adam", description="Megatron optimizer type.")
    lr: float | None = Field(
        None, ge=0, description="Peak learning rate; None = policy.learning_rate (derived when the config is resolved)."
    )
    min_lr: float = Field(0.0, ge=0, description="Floor of the decayed learning rate.")
    weight_decay: float = Field(0.01, ge=0, description="Weight decay.")
    bf16: bool = Field(False, description="bf16 model weights (must match policy.precision 'bfloat16').")
    fp16: bool = Field(False, description="fp16 model weights (must match policy.precision 'float16').")
    params_dtype: Precision = Field(
        "float32",
        description="Dtype of the optimizer's main (master) weights: 'float32' (fp32 master weights, the "
        "standard mixed precision with a bf16/fp16 model), or policy.precision itself (low-precision master "
        "weights, which needs use_precision_aware_optimizer).",
    )
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="Adam beta1.")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="Adam beta2.")
    adam_eps: float = Field(1e-8, gt=0, description="Adam epsilon.")
    sgd_momentum: float = Field(0.9, ge=0, description="SGD momentum.")
    use_distributed_optimizer: bool = Field(False, description="Shard optimizer state across data-parallel ranks.")
    use_precision_aware_optimizer: bool = Field(False, description="Let the optimizer keep low-precision state.")
    clip_grad: float | None = Field(
        None,
        description="Leave unset: gradient clipping has one setting, policy.max_grad_norm. "
        "If given it must equal policy.max_grad_norm.",
    )


class MegatronSchedulerConfig(StrictModel):
    """megatron-core learning-rate and weight-decay schedule."""

    start_weight_decay: float = Field(0.01, ge=0, description="Weight decay at the first step.")
    end_weight_decay: float = Field(0.01, ge=0, description="Weight decay at the last step.")
    weight_decay_incr_style: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="How weight decay moves from start to end."
    )
    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"] = Field(
        "constant", description="Learning-rate decay schedule."
    )
    lr_decay_iters: PositiveInt | None = Field(None, description="Steps over which lr decays; None = no decay horizon.")
    lr_warmup_iters: int = Field(0, ge=0, description="Linear warm-up steps.")
    lr_warmup_init: float = Field(0.0, ge=0, description="Learning rate at the start of warm-up.")


class MegatronDDPConfig(StrictModel):
    """megatron-core distributed data parallel settings."""

    grad_reduce_in_fp32: bool = Field(False, description="Reduce gradients in fp32.")
    overlap_grad_reduce: bool = Field(False, description="Overlap gradient reduce-scatter with backward.")
    overlap_param_gather: bool = Field(False, description="Overlap parameter all-gather with forward.")
    average_in_collective: bool = Field(
        False, description="Average (rather than sum then scale) inside the collective."
    )
    use_custom_fsdp: bool = Field(False, description="Use Megatron's custom FSDP.")
    data_parallel_sharding_strategy: Literal["no_shard", "optim", "optim_grads", "optim_grads_params"] = Field(
        "optim_grads_params",
        description="What Megatron's custom FSDP shards across data-parallel ranks; "
        "only used with use_custom_fsdp (not supported), so any other value is rejected.",
    )


class MegatronConfig(StrictModel):
    """megatron-core training backend (TP, PP, CP)."""

    enabled: bool = Field(
        False, description="Train with the megatron-core backend ('megatron'), as policy.backend: megatron does."
    )
    empty_unused_memory_level: int = Field(0, ge=0, le=2, description="How aggressively to empty the CUDA cache (0-2).")
    activation_checkpointing: bool = Field(False, description="Recompute activations in the backward pass.")
    converter_type: str | None = Field(
        None,
        description="HF architecture used for weight conversion (e.g. 'LlamaForCausalLM'); None = from the model "
        "config.",
    )
    tensor_model_parallel_size: PositiveInt = Field(1, description="Tensor-parallel degree (tp).")
    pipeline_model_parallel_size: PositiveInt = Field(1, description="Pipeline-parallel degree (pp).")
    num_layers_in_first_pipeline_stage: PositiveInt | None = Field(
        None, description="Layers on the first pipeline stage; None = even split."
    )
    num_layers_in_last_pipeline_stage: PositiveInt | None = Field(
        None, description="Layers on the last pipeline stage; None = even split."
    )
    context_parallel_size: PositiveInt = Field(
        1,
        description="Context-parallel degree (cp): each rank runs 2 of the 2·cp chunks of every sequence, attention "
        "all-gathers keys and values over cp; with pipeline stages and experts too (the routers' logits are "
        "gathered over cp for the aux loss).",
    )
    pipeline_dtype: Precision | None = Field(
        None,
        description="Dtype of tensors sent between pipeline stages; None = policy.precision (derived when the "
        "config is resolved).",
    )
    sequence_parallel: bool = Field(
        False,
        description="Megatron sequence parallelism: activations outside the tensor-parallel regions split along "
        "the sequence over the tp ranks (each micro-batch is padded to a multiple of tp as well as of "
        "policy.make_sequence_length_divisible_by).",
    )
    # -- mixture of experts (models with experts only; a dense model refuses non-default values) --------
    expert_model_parallel_size: PositiveInt = Field(
        1, description="Expert-parallel degree (ep): each rank of an ep group holds num_experts / ep experts."
    )
    expert_tensor_parallel_size: PositiveInt = Field(
        1, description="Tensor parallelism inside each expert; only 1 (experts whole on their rank) is supported."
    )
    moe_token_dispatcher_type: Literal["alltoall", "allgather", "flex"] = Field(
        "alltoall",
        description="How tokens reach their experts' ranks: 'alltoall' (the one this backend runs); "
        "'allgather' (crashes a CPU worker in megatron-core 0.16.1) and 'flex' (DeepEP/HybridEP, CUDA) are refused.",
    )
    moe_router_dtype: Literal["fp32", "fp64"] | None = Field(
        None, description="Dtype of the router's logits, routing and aux loss; None = the model's dtype."
    )
    moe_router_load_balancing_type: Literal["aux_loss", "none", "seq_aux_loss", "global_aux_loss", "sinkhorn"] = Field(
        "aux_loss",
        description="'aux_loss': Hugging Face's Switch load-balancing loss (load_balancing_loss_func, pooled "
        "over layers, per micro-batch, weighted by its share of the step's tokens) times moe_aux_loss_coeff "
        "is added to the training loss; 'none': no aux loss. Other megatron types are refused.",
    )
    moe_aux_loss_coeff: float | None = Field(
        None, ge=0, description="Weight of the aux loss; None = the model config's router_aux_loss_coef."
    )
    moe_expert_capacity_factor: float | None = Field(
        None, description="Token dropping at this capacity; only null (no dropping, as Hugging Face) is supported."
    )
    moe_router_bias_update_rate: float = Field(
        0.0, ge=0, description="Expert-bias (aux-loss-free) balancing rate; only 0 (Qwen3-MoE has no expert bias)."
    )
    freeze_moe_router: bool = Field(False, description="Do not train the routers' weights.")
    moe_enable_deepep: bool = Field(
        False, description="DeepEP dispatch kernels (CUDA only); must be false on this backend."
    )
    defer_fp32_logits: bool = Field(
        False,
        description="Keep the output layer's logits in the training dtype (not float32) until the logprob/loss "
        "computation casts them: less memory with bf16, float32 maths where it matters.",
    )
    optimizer: MegatronOptimizerConfig = Field(
        default_factory=MegatronOptimizerConfig, description="Megatron optimizer."
    )
    scheduler: MegatronSchedulerConfig = Field(
        default_factory=MegatronSchedulerConfig, description="Megatron lr/wd schedule."
    )
    distributed_data_parallel_config: MegatronDDPConfig = Field(
        default_factory=MegatronDDPConfig, description="Megatron DDP settings."
    )

    @model_validator(mode="after")
    def _derive_from_policy(self, info: ValidationInfo) -> MegatronConfig:
        """lr and pipeline_dtype left null follow the policy (rlcore passes it as the context's ``owner``)."""
        policy = (info.context or {}).get("owner")
        if policy is None:
            return self
        if self.optimizer.lr is None:
            fill_derived(self, optimizer=derived(self.optimizer, lr=policy.learning_rate))
        if self.pipeline_dtype is None:
            fill_derived(self, pipeline_dtype=policy.precision)
        return self


def megatron_section(policy: Any, given: Any = None) -> MegatronConfig:
    """``given`` (the section rlcore validated), else ``policy.megatron_cfg`` validated here, derived values
    filled in from ``policy``. Raises ``rlcore.config.ConfigError`` naming the dotted path of a bad value."""
    if given is not None:
        return given
    from rlcore.config import ConfigError, validate_section

    raw = (getattr(policy, "backend_sections", None) or {}).get(SECTION, {})
    section, problems = validate_section(MegatronConfig, raw, f"policy.{SECTION}", context={"owner": policy})
    if section is None:
        raise ConfigError(problems)
    return section


def config_check(request: Any) -> list[str]:
    """What rlcore asks before anything starts (a ``rlcore.plugins.LayoutRequest``).

    On a CPU cluster every check is decided here. On GPUs, TransformerEngine is
    the workers' to say, so only what no machine can run is reported.
    """
    policy, section = request.policy, request.section
    return (
        torch_optimizer_problems(policy)
        + clipping_problems(policy, section)
        + safetensors_problems(policy.model_name)
        + moe_model_problems(section, policy.model_name, request.world_size)
        + megatron_config_problems(policy, section, cuda=request.use_gpu, transformer_engine=request.use_gpu)
    )


def clipping_problems(policy: Any, section: MegatronConfig) -> list[str]:
    """NeMo-RL's megatron clips by optimizer.clip_grad; rlcore has one clipping setting, policy.max_grad_norm."""
    clip = section.optimizer.clip_grad
    if clip is None or clip == policy.max_grad_norm:
        return []
    norm = "null" if policy.max_grad_norm is None else policy.max_grad_norm
    return [
        f"{_M}optimizer.clip_grad: is {clip} but policy.max_grad_norm is {norm}; gradient clipping has one "
        "setting: remove clip_grad and set policy.max_grad_norm (null disables clipping)"
    ]


def safetensors_problems(model_name: str) -> list[str]:
    """The HF -> Megatron converter reads safetensors only; transformers (dtensor, fsdp1) also reads
    ``pytorch_model.bin``, so a model directory with only that is this backend's problem."""
    directory = Path(model_name)
    if (
        not directory.is_dir()
        or any(directory.glob("*.safetensors"))
        or not any((directory / name).is_file() for name in ("pytorch_model.bin", "pytorch_model.bin.index.json"))
    ):
        return []
    return [
        f"policy.model_name: {directory} has only pytorch_model.bin weights, but the megatron backend reads "
        "safetensors only; convert once with AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir) "
        "(writes model.safetensors)"
    ]


def torch_optimizer_problems(policy: Any) -> list[str]:
    """policy.optimizer / policy.scheduler build torch objects in dtensor and fsdp1; megatron never reads them.

    An optimizer section saying only what an absent one means (AdamW at policy.learning_rate) is no setting.
    """
    default = type(policy.optimizer)()
    problems = []
    if policy.optimizer.name != default.name or policy.optimizer.kwargs not in ({}, {"lr": policy.learning_rate}):
        problems.append(
            "policy.optimizer: is set, but the megatron backend builds megatron-core's optimizer from "
            "policy.megatron_cfg.optimizer (its lr defaults to policy.learning_rate): remove "
            "policy.optimizer"
        )
    if policy.scheduler is not None:
        problems.append(
            "policy.scheduler: is set, but the megatron backend schedules the learning rate by "
            "policy.megatron_cfg.scheduler: remove policy.scheduler"
        )
    return problems


def megatron_config_problems(
    policy: Any, section: MegatronConfig | None = None, *, cuda: bool, transformer_engine: bool
) -> list[str]:
    """Problem lines for running ``policy`` (a ``PolicyConfig``) with the megatron backend; ``section``: its
    validated ``megatron_cfg`` (None: validated from ``policy`` here)."""
    m = megatron_section(policy, section)
    opt = m.optimizer
    ddp = m.distributed_data_parallel_config
    where = "this machine has no CUDA GPU" if not cuda else "TransformerEngine is not installed"
    problems: list[str] = []

    # Features built on TransformerEngine kernels: impossible without a GPU, and not wired
    # into this backend yet (it builds the local, TransformerEngine-free layer spec).
    te_only = {
        "policy.sequence_packing.enabled": (policy.sequence_packing.enabled, "packed (THD) sequences", "false"),
    }
    for path, (wanted, what, fix) in te_only.items():
        if not wanted:
            continue
        if cuda and transformer_engine:
            problems.append(
                f"{path}: {what} is not implemented by the megatron backend yet (it needs the "
                f"TransformerEngine layer spec): set it to {fix}"
            )
        else:
            problems.append(
                f"{path}: {what} needs TransformerEngine kernels, i.e. a CUDA GPU, and {where}: set it to {fix}"
            )
    if policy.dynamic_batching.enabled:
        problems.append("policy.dynamic_batching.enabled: not supported by the megatron backend: set it to false")

    half = {"bfloat16": "bf16", "float16": "fp16"}.get(policy.precision)
    for flag in ("bf16", "fp16"):
        if getattr(opt, flag) != (half == flag):
            problems.append(
                f"{_M}optimizer.{flag}: is {getattr(opt, flag)} but policy.precision is "
                f"{policy.precision!r}; the optimizer's precision follows the model's: set "
                f"{_M}optimizer.{flag}={'true' if half == flag else 'false'}"
            )
    # params_dtype is the dtype of the optimizer's main (master) weights: fp32 (the standard mixed
    # precision, NeMo-RL's default) or the model's own dtype, which needs the precision-aware optimizer.
    if opt.params_dtype not in ("float32", policy.precision):
        problems.append(
            f"{_M}optimizer.params_dtype: is {opt.params_dtype!r} but the model is {policy.precision!r}; "
            "the optimizer's main weights are float32 or the model's own dtype: set 'float32'"
        )
    elif opt.params_dtype != "float32" and not opt.use_precision_aware_optimizer:
        problems.append(
            f"{_M}optimizer.params_dtype: is {opt.params_dtype!r}: low-precision main weights need "
            f"{_M}optimizer.use_precision_aware_optimizer=true; or set 'float32' (fp32 main weights)"
        )
    if opt.use_precision_aware_optimizer and not opt.use_distributed_optimizer:
        problems.append(
            f"{_M}optimizer.use_precision_aware_optimizer: needs {_M}optimizer.use_distributed_optimizer=true"
        )
    elif opt.use_precision_aware_optimizer and not (cuda and transformer_engine):
        if opt.params_dtype != "float32":
            problems.append(
                f"{_M}optimizer.use_precision_aware_optimizer: is true with {opt.params_dtype} main weights but "
                f"{where}; low-precision optimizer state needs TransformerEngine's FusedAdam (torch's Adam has no "
                f"such state): set {_M}optimizer.params_dtype='float32' (and the precision-aware optimizer changes "
                "nothing computed) or run on a GPU with TransformerEngine"
            )
        else:
            warnings.warn(
                f"ignored: {_M}optimizer.use_precision_aware_optimizer=true ({where}): with float32 main weights "
                "its state is the distributed optimizer's own (float32 main weights and Adam moments), which runs "
                "without TransformerEngine's FusedAdam: the same update",
                UserWarning,
                stacklevel=2,
            )
    if opt.use_distributed_optimizer and opt.optimizer == "sgd":
        problems.append(
            f"{_M}optimizer.use_distributed_optimizer: is true with optimizer 'sgd'; megatron-core's distributed "
            "optimizer checkpoints Adam's state only (exp_avg, exp_avg_sq): use optimizer 'adam' or set it to false"
        )

    if ddp.average_in_collective:
        problems.append(
            f"{_M}distributed_data_parallel_config.average_in_collective: is true, but rlcore sums "
            "gradients over data-parallel ranks (the loss is already normalised by the global token "
            "count, design.md §2.3): set it to false"
        )
    if ddp.use_custom_fsdp:
        problems.append(
            f"{_M}distributed_data_parallel_config.use_custom_fsdp: Megatron FSDP is not supported by "
            "the megatron backend: set it to false"
        )
    default = type(ddp).model_fields["data_parallel_sharding_strategy"].default
    if ddp.data_parallel_sharding_strategy != default and not ddp.use_custom_fsdp:
        problems.append(
            f"{_M}distributed_data_parallel_config.data_parallel_sharding_strategy: is "
            f"'{ddp.data_parallel_sharding_strategy}', but it only applies to Megatron's custom FSDP "
            f"(use_custom_fsdp), which the megatron backend does not support: leave it at '{default}'"
        )
    if ddp.overlap_param_gather and not opt.use_distributed_optimizer:
        problems.append(
            f"{_M}distributed_data_parallel_config.overlap_param_gather: needs "
            f"{_M}optimizer.use_distributed_optimizer=true"
        )

    # The MoE settings change nothing of a dense model: refused for a model with experts, which the workers (whose
    # model_name is a local directory) always know, and a config check knows when the model is on this machine.
    if model_experts(policy.model_name):
        problems += moe_problems(m)

    sched = m.scheduler
    if sched.lr_decay_style not in ("constant",) and sched.lr_decay_iters is None:
        problems.append(
            f"{_M}scheduler.lr_decay_iters: is null but lr_decay_style is {sched.lr_decay_style!r}; "
            "set the number of steps over which the learning rate decays"
        )
    if sched.weight_decay_incr_style == "constant" and sched.start_weight_decay != sched.end_weight_decay:
        problems.append(
            f"{_M}scheduler.end_weight_decay: is {sched.end_weight_decay} but start_weight_decay is "
            f"{sched.start_weight_decay} with weight_decay_incr_style 'constant': make them equal"
        )
    return problems


def moe_problems(m: MegatronConfig) -> list[str]:
    """The mixture-of-experts settings this backend cannot honour, one line each. Settings needing the model
    (ep divides the experts, a dense model with ep > 1) are checked where the model config is read."""
    problems = []
    if m.expert_tensor_parallel_size != 1:
        problems.append(
            f"{_M}expert_tensor_parallel_size: is {m.expert_tensor_parallel_size}, but the megatron backend keeps "
            "each expert whole on its rank: set it to 1 (split experts with expert_model_parallel_size)"
        )
    if m.moe_token_dispatcher_type == "flex" or m.moe_enable_deepep:
        path = "moe_enable_deepep" if m.moe_enable_deepep else "moe_token_dispatcher_type"
        problems.append(
            f"{_M}{path}: DeepEP/HybridEP dispatch needs CUDA kernels the megatron backend does not build: "
            "use moe_token_dispatcher_type 'alltoall' and moe_enable_deepep false"
        )
    if m.moe_token_dispatcher_type == "allgather":
        problems.append(
            f"{_M}moe_token_dispatcher_type: 'allgather' is not supported by the megatron backend (megatron-core "
            "0.16.1's all-gather dispatcher crashes a CPU worker; the all-to-all computes the same numbers): "
            "set it to 'alltoall'"
        )
    if m.moe_router_load_balancing_type not in ("aux_loss", "none"):
        problems.append(
            f"{_M}moe_router_load_balancing_type: is {m.moe_router_load_balancing_type!r}, which changes the "
            "loss in a way the megatron backend does not implement: use 'aux_loss' (Hugging Face's) or 'none'"
        )
    if m.moe_expert_capacity_factor is not None:
        problems.append(
            f"{_M}moe_expert_capacity_factor: is {m.moe_expert_capacity_factor}, but token dropping would compute "
            "another model than the Hugging Face checkpoint's (which drops none): set it to null"
        )
    if m.moe_router_bias_update_rate != 0:
        problems.append(
            f"{_M}moe_router_bias_update_rate: is {m.moe_router_bias_update_rate}, but Qwen3-MoE routers have no "
            "expert bias to update: set it to 0"
        )
    return problems


def moe_model_problems(m: MegatronConfig, model_name: str, world_size: int) -> list[str]:
    """Expert parallelism against the model's ``config.json`` and the world size."""
    ep = m.expert_model_parallel_size
    path = f"{_M}expert_model_parallel_size"
    problems = []
    if world_size % (ep * m.expert_tensor_parallel_size * m.pipeline_model_parallel_size):
        problems.append(
            f"{path}: {ep} does not divide the {world_size // m.pipeline_model_parallel_size} ranks of a pipeline "
            "stage: choose a divisor"
        )
    experts = model_experts(model_name)
    if experts is None:
        return problems
    if ep > 1 and not experts:
        problems.append(f"{path}: is {ep} but {model_name} has no experts: set it to 1")
    elif experts and experts % ep:
        problems.append(f"{path}: {ep} does not divide the model's {experts} experts: choose a divisor")
    tp = m.tensor_model_parallel_size
    if experts and tp > 1 and not m.sequence_parallel:
        problems.append(
            f"{_M}sequence_parallel: is false, but megatron-core trains a model with experts at "
            f"tensor_model_parallel_size {tp} only with sequence parallelism: set it to true"
        )
    if experts and tp > 1 and ep == 1:
        # megatron-core marks expert weights as dense ones at ep 1 (``allreduce``), so their gradients are
        # summed over the dense data-parallel group only, not over the tp ranks that routed other tokens.
        problems.append(
            f"{path}: is 1 with tensor_model_parallel_size {tp}: megatron-core then sums the experts' gradients "
            "over the data-parallel ranks only, not over the tensor-parallel ranks that routed other tokens: "
            f"set it to a multiple of {tp} that divides the experts"
        )
    if experts and m.pipeline_model_parallel_size > 1:
        problems.append(
            f"{_M}pipeline_model_parallel_size: is {m.pipeline_model_parallel_size}, but the megatron backend "
            "computes the MoE aux loss over every layer of one rank: set it to 1 for a model with experts"
        )
    return problems


__all__ = [
    "MegatronConfig",
    "MegatronDDPConfig",
    "MegatronOptimizerConfig",
    "MegatronSchedulerConfig",
    "clipping_problems",
    "config_check",
    "megatron_config_problems",
    "megatron_section",
    "model_experts",
    "moe_model_problems",
    "moe_problems",
    "safetensors_problems",
    "torch_optimizer_problems",
]
