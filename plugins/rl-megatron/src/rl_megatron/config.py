"""Checks of a policy config that the megatron backend cannot run, by what it implements and where it runs.

The schema (``rlcore.config.MegatronConfig``) validates values; these rules
say which valid settings cannot run *here*: features that need
TransformerEngine kernels or CUDA tensors, settings that would change the
meaning of a training step, and torch optimizer settings megatron never reads.
Each problem names the dotted path, the value and the fix, like every rlcore
config error. rlcore runs :func:`config_check` (the spec's ``config_check``)
when it resolves a config, before anything starts; the worker runs
:func:`megatron_config_problems` again on its own machine, where it knows
whether TransformerEngine is installed. Light module: no torch, no megatron.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_M = "policy.megatron_cfg."


def config_check(request: Any) -> list[str]:
    """What rlcore asks before anything starts (a ``rlcore.plugins.LayoutRequest``).

    On a CPU cluster every check is decided here. On GPUs, TransformerEngine is
    the workers' to say, so only what no machine can run is reported.
    """
    policy = request.policy
    return (torch_optimizer_problems(policy) + safetensors_problems(policy.model_name)
            + megatron_config_problems(policy, cuda=request.use_gpu, transformer_engine=request.use_gpu))


def safetensors_problems(model_name: str) -> list[str]:
    """The HF -> Megatron converter reads safetensors only; transformers (dtensor, fsdp1) also reads
    ``pytorch_model.bin``, so a model directory with only that is this backend's problem."""
    directory = Path(model_name)
    if not directory.is_dir() or any(directory.glob("*.safetensors")) or \
            not any((directory / name).is_file() for name in ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        return []
    return [f"policy.model_name: {directory} has only pytorch_model.bin weights, but the megatron backend reads "
            "safetensors only; convert once with AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir) "
            "(writes model.safetensors)"]


def torch_optimizer_problems(policy: Any) -> list[str]:
    """policy.optimizer / policy.scheduler build torch objects in dtensor and fsdp1; megatron never reads them.

    An optimizer section saying only what an absent one means (AdamW at policy.learning_rate) is no setting.
    """
    default = type(policy.optimizer)()
    problems = []
    if policy.optimizer.name != default.name or policy.optimizer.kwargs not in ({}, {"lr": policy.learning_rate}):
        problems.append("policy.optimizer: is set, but the megatron backend builds megatron-core's optimizer from "
                        "policy.megatron_cfg.optimizer (its lr defaults to policy.learning_rate): remove "
                        "policy.optimizer")
    if policy.scheduler is not None:
        problems.append("policy.scheduler: is set, but the megatron backend schedules the learning rate by "
                        "policy.megatron_cfg.scheduler: remove policy.scheduler")
    return problems


def megatron_config_problems(policy: Any, *, cuda: bool, transformer_engine: bool) -> list[str]:
    """Problem lines for running ``policy`` (a ``PolicyConfig``) with the megatron backend."""
    m = policy.megatron_cfg
    opt = m.optimizer
    ddp = m.distributed_data_parallel_config
    where = "this machine has no CUDA GPU" if not cuda else "TransformerEngine is not installed"
    problems: list[str] = []

    # Features built on TransformerEngine kernels: impossible without a GPU, and not wired
    # into this backend yet (it builds the local, TransformerEngine-free layer spec).
    te_only = {
        f"{_M}sequence_parallel": (m.sequence_parallel, "sequence parallelism", "false"),
        f"{_M}context_parallel_size": (m.context_parallel_size > 1, "context parallelism", "1"),
        "policy.sequence_packing.enabled": (policy.sequence_packing.enabled, "packed (THD) sequences", "false"),
    }
    for path, (wanted, what, fix) in te_only.items():
        if not wanted:
            continue
        if cuda and transformer_engine:
            problems.append(f"{path}: {what} is not implemented by the megatron backend yet (it needs the "
                            f"TransformerEngine layer spec): set it to {fix}")
        else:
            problems.append(f"{path}: {what} needs TransformerEngine kernels, i.e. a CUDA GPU, and {where}: "
                            f"set it to {fix}")
    if policy.dynamic_batching.enabled:
        problems.append("policy.dynamic_batching.enabled: not supported by the megatron backend: set it to false")

    if not cuda:
        if policy.precision != "float32":
            problems.append(f"policy.precision: is {policy.precision!r} but {where}; megatron-core's mixed-precision "
                            "optimizer only accepts CUDA tensors: use 'float32' on CPU")
        if opt.use_distributed_optimizer:
            problems.append(f"{_M}optimizer.use_distributed_optimizer: is true but {where}; megatron-core's "
                            "distributed optimizer only accepts CUDA tensors: set it to false")
    half = {"bfloat16": "bf16", "float16": "fp16"}.get(policy.precision)
    for flag in ("bf16", "fp16"):
        if getattr(opt, flag) != (half == flag):
            problems.append(f"{_M}optimizer.{flag}: is {getattr(opt, flag)} but policy.precision is "
                            f"{policy.precision!r}; the optimizer's precision follows the model's: set "
                            f"{_M}optimizer.{flag}={'true' if half == flag else 'false'}")
    # params_dtype is the dtype of the optimizer's main (master) weights: fp32 (the standard mixed
    # precision, NeMo-RL's default) or the model's own dtype, which needs the precision-aware optimizer.
    if opt.params_dtype not in ("float32", policy.precision):
        problems.append(f"{_M}optimizer.params_dtype: is {opt.params_dtype!r} but the model is {policy.precision!r}; "
                        "the optimizer's main weights are float32 or the model's own dtype: set 'float32'")
    elif opt.params_dtype != "float32" and not opt.use_precision_aware_optimizer:
        problems.append(f"{_M}optimizer.params_dtype: is {opt.params_dtype!r}: low-precision main weights need "
                        f"{_M}optimizer.use_precision_aware_optimizer=true; or set 'float32' (fp32 main weights)")
    if opt.use_precision_aware_optimizer and not opt.use_distributed_optimizer:
        problems.append(f"{_M}optimizer.use_precision_aware_optimizer: needs "
                        f"{_M}optimizer.use_distributed_optimizer=true")

    if ddp.average_in_collective:
        problems.append(f"{_M}distributed_data_parallel_config.average_in_collective: is true, but rlcore sums "
                        "gradients over data-parallel ranks (the loss is already normalised by the global token "
                        "count, design.md §2.3): set it to false")
    if ddp.use_custom_fsdp:
        problems.append(f"{_M}distributed_data_parallel_config.use_custom_fsdp: Megatron FSDP is not supported by "
                        "the megatron backend: set it to false")
    default = type(ddp).model_fields["data_parallel_sharding_strategy"].default
    if ddp.data_parallel_sharding_strategy != default and not ddp.use_custom_fsdp:
        problems.append(f"{_M}distributed_data_parallel_config.data_parallel_sharding_strategy: is "
                        f"'{ddp.data_parallel_sharding_strategy}', but it only applies to Megatron's custom FSDP "
                        f"(use_custom_fsdp), which the megatron backend does not support: leave it at '{default}'")
    if ddp.overlap_param_gather and not opt.use_distributed_optimizer:
        problems.append(f"{_M}distributed_data_parallel_config.overlap_param_gather: needs "
                        f"{_M}optimizer.use_distributed_optimizer=true")

    sched = m.scheduler
    if sched.lr_decay_style not in ("constant",) and sched.lr_decay_iters is None:
        problems.append(f"{_M}scheduler.lr_decay_iters: is null but lr_decay_style is {sched.lr_decay_style!r}; "
                        "set the number of steps over which the learning rate decays")
    if sched.weight_decay_incr_style == "constant" and sched.start_weight_decay != sched.end_weight_decay:
        problems.append(f"{_M}scheduler.end_weight_decay: is {sched.end_weight_decay} but start_weight_decay is "
                        f"{sched.start_weight_decay} with weight_decay_incr_style 'constant': make them equal")
    return problems


__all__ = ["config_check", "megatron_config_problems", "safetensors_problems", "torch_optimizer_problems"]
