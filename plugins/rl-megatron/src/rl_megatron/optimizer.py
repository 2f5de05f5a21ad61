"""megatron-core's DDP wrapper, optimizer and scheduler for one rank, and the checkpoint handling of its
distributed optimizer.

The optimizer is megatron's own (``get_megatron_optimizer``): fp32 (``FP32Optimizer``), mixed precision
(bf16/fp16 model weights with fp32 main weights, ``Float16OptimizerWithFloat16Params``) or distributed (each
data-parallel rank keeps the main weights and Adam moments of its 1/dp slice of the gradient buffer,
``DistributedOptimizer``). On a CPU process :mod:`rl_megatron.cpu_compat` gets them past their CUDA checks.

The distributed optimizer's checkpoint finds each parameter's main weights and Adam state through
``model_param_group_index_map`` (parameter -> position in its optimizer group). megatron-core 0.16.1 numbers the
parameters in grad-buffer order, but puts the float32 parameters of a group before its bf16/fp16 ones: in a group
holding both (a bf16 Qwen2's no-weight-decay group: its bf16 qkv biases beside the float32 RMSNorm weights of the
local spec's torch norm) the numbers point at other parameters' state, and saving fails (a size mismatch in
``get_parameter_state_dp_zero``) or, where the sizes happen to agree, stores one parameter's state under
another's name. :func:`build` renumbers them in the group's own order (:func:`repair_group_index_map`).

Without TransformerEngine or Apex (torch's Adam), the checkpoint needs three more repairs, all in
:func:`load_distributed_state`:

- megatron builds the load request from ``state_dict()``, which reads each parameter's Adam ``step``; a fresh
  optimizer has no state yet, so it fails (``assert len(steps) == 1``). The state is created first, as torch's
  Adam would on its first step (zero moments, step 0).
- ``load_state_dict`` copies the loaded tensors into every key of each parameter's state, ``step`` included,
  which the loaded tensors do not have (``KeyError: 'step'``). ``step`` is set aside while they are copied.
- ``load_state_dict`` gives every parameter's state *the same* ``step`` tensor, which torch's Adam then
  increments in place once per parameter per step: the bias correction of every later step is wrong. Each
  state gets its own copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

#: policy.precision -> torch dtype.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def init_sgd_state(opt: torch.optim.Optimizer, config: Any = None) -> None:
    """Create SGD's momentum buffers (zeros, which SGD without dampening treats like absent ones)
    so that a checkpoint's state has somewhere to load into."""
    for group in opt.param_groups:
        if group.get("momentum", 0):
            for p in group["params"]:
                if opt.state[p].get("momentum_buffer") is None:
                    opt.state[p]["momentum_buffer"] = torch.zeros_like(p.data)


@dataclass
class TrainingState:
    """What :func:`build` returns: the DDP-wrapped model, megatron's optimizer and its scheduler."""

    model: torch.nn.Module
    optimizer: Any
    scheduler: Any


def build(gpt: torch.nn.Module, tconfig: Any, mcfg: Any, policy: Any, *, fused_adam: bool) -> TrainingState:
    """Wrap ``gpt`` in megatron's DDP and build the optimizer and scheduler that ``policy.megatron_cfg``
    (``mcfg``) describes. Sets ``tconfig``'s gradient hooks (finalize, no_sync, loss scaling).

    ``fused_adam``: TransformerEngine's FusedAdam is there (a GPU with TransformerEngine); without it a
    precision-aware optimizer with float32 main weights is the plain distributed one, whose state is the same
    (megatron_config_problems refused low-precision state without it)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    o = mcfg.optimizer
    d = mcfg.distributed_data_parallel_config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=d.grad_reduce_in_fp32,
        overlap_grad_reduce=d.overlap_grad_reduce,
        overlap_param_gather=d.overlap_param_gather,
        average_in_collective=False,
        use_distributed_optimizer=o.use_distributed_optimizer,
    )
    model = DistributedDataParallel(config=tconfig, ddp_config=ddp_config, module=gpt)
    tconfig.finalize_model_grads_func = _finalize_grads_without_token_scaling()
    tconfig.no_sync_func = model.no_sync
    # main_params_dtype is the main (master) weights' dtype: fp32 unless the precision-aware optimizer
    # keeps them in the model's dtype (megatron_config_problems checked the combination).
    precision_aware = o.use_precision_aware_optimizer and fused_adam
    main = DTYPES[o.params_dtype] if precision_aware else torch.float32
    opt_config = OptimizerConfig(
        optimizer=o.optimizer,
        lr=o.lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        bf16=o.bf16,
        fp16=o.fp16,
        params_dtype=DTYPES[policy.precision],
        main_params_dtype=main,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps,
        sgd_momentum=o.sgd_momentum,
        use_distributed_optimizer=o.use_distributed_optimizer,
        use_precision_aware_optimizer=precision_aware,
        # One clipping setting across backends: policy.max_grad_norm (None = no clipping).
        clip_grad=float(policy.max_grad_norm) if policy.max_grad_norm is not None else 0.0,
    )
    optimizer = get_megatron_optimizer(opt_config, [model])
    for opt in parts(optimizer):
        if hasattr(opt, "model_param_group_index_map"):  # a DistributedOptimizer
            repair_group_index_map(opt)
        if getattr(opt, "init_state_fn", False) is None:
            # megatron-core gives SGD no state initialiser, so loading its checkpoint fails.
            opt.init_state_fn = init_sgd_state
    tconfig.grad_scale_func = optimizer.scale_loss
    return TrainingState(model, optimizer, _scheduler(optimizer, mcfg))


def _finalize_grads_without_token_scaling() -> Callable[..., None]:
    from megatron.core.distributed import finalize_model_grads

    def finalize_grads(model: list, num_tokens: Any = None, **kwargs: Any) -> None:
        # All-reduce over dp (a sum: rlcore's loss is already normalised by the step's token count), tied-embedding
        # and q/k-norm reductions; never a division by a token count.
        finalize_model_grads(model, None, **kwargs)

    return finalize_grads


def _scheduler(optimizer: Any, mcfg: Any) -> Any:
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    o, s = mcfg.optimizer, mcfg.scheduler
    decay_steps = s.lr_decay_iters or max(1, s.lr_warmup_iters + 1)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=s.lr_warmup_init,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=s.lr_warmup_iters,
        lr_decay_steps=decay_steps,
        lr_decay_style=s.lr_decay_style,
        start_wd=s.start_weight_decay,
        end_wd=s.end_weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style=s.weight_decay_incr_style,
        wsd_decay_steps=decay_steps,
        lr_wsd_decay_style="linear",
    )


def parts(optimizer: Any) -> list[Any]:
    """The megatron optimizers inside ``optimizer`` (a ``ChainedOptimizer`` holds one per parameter kind)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def distributed_checkpoint_metadata(on_gpu: bool) -> dict[str, Any]:
    """How the distributed optimizer writes its state. Its default format (``fully_sharded_model_space``) builds
    ShardedTensors with a ``flattened_range``, which megatron-core 0.16.1's checkpointing refuses;
    ``fully_reshardable`` gathers each parameter's state over dp into model-shaped tensors (reshardable over dp,
    tp and pp). Without a GPU the gather goes through gloo to dp rank 0 (the memory-efficient variant): the other
    one moves the shards with ``.cuda()``."""
    return {
        "distrib_optim_sharding_type": "fully_reshardable",
        "distrib_optim_fully_reshardable_mem_efficient": not on_gpu,
    }


def repair_group_index_map(opt: Any) -> None:
    """Point ``opt.model_param_group_index_map`` (a megatron ``DistributedOptimizer``'s parameter ->
    ``(group index, position)``) at each parameter's own main weights in ``opt.optimizer.param_groups`` (see the
    module docstring). The position is found by identity: each group's main weights are the shards megatron made
    of its float32 and its bf16/fp16 model parameters (``shard_fp32_groups``, and ``shard_fp32_from_float16_groups``
    or, with the precision-aware optimizer, ``shard_float16_groups``), in the order it built them."""
    half_shards = (
        opt.shard_float16_groups
        if opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
        else opt.shard_fp32_from_float16_groups
    )
    repaired: dict[Any, tuple[int, int]] = {}
    for index, group in enumerate(opt.optimizer.param_groups):
        model_param_of = {
            id(shard): model_param
            for model_params, shards in (
                (opt.model_fp32_groups[index], opt.shard_fp32_groups[index]),
                (opt.model_float16_groups[index], half_shards[index]),
            )
            for model_param, shard in zip(model_params, shards, strict=True)
        }
        for position, main_param in enumerate(group["params"]):
            repaired[model_param_of[id(main_param)]] = (index, position)
    if repaired.keys() != opt.model_param_group_index_map.keys():
        raise RuntimeError(
            "megatron's distributed optimizer: its parameter groups hold other parameters than its grad buffers "
            f"({len(repaired)} vs {len(opt.model_param_group_index_map)}); this megatron-core version lays them "
            "out differently from the one rl_megatron.optimizer.repair_group_index_map was written for"
        )
    opt.model_param_group_index_map = repaired


def load_distributed_state(optimizer: Any, state_dict: Any) -> None:
    """``optimizer.load_state_dict(state_dict)`` for a distributed optimizer over torch's Adam, with the two
    repairs of the module docstring: ``step`` set aside while the loaded tensors are copied in, then unshared."""
    originals = []
    for opt in parts(optimizer):
        if _is_torch_adam(opt.optimizer) and not opt.config.use_precision_aware_optimizer:
            originals.append((opt, opt._set_main_param_and_optimizer_states))
            opt._set_main_param_and_optimizer_states = _setting_aside_step(opt)
    try:
        optimizer.load_state_dict(state_dict)
    finally:
        for opt, _ in originals:
            del opt._set_main_param_and_optimizer_states  # the class's method again
    _unshare_adam_steps(optimizer)


def _setting_aside_step(opt: Any) -> Callable[[Any, dict], None]:
    set_states = type(opt)._set_main_param_and_optimizer_states

    def set_main_param_and_optimizer_states(model_param: Any, tensors: dict) -> None:
        group_index, group_order = opt.model_param_group_index_map[model_param]
        state = opt.optimizer.state[opt.optimizer.param_groups[group_index]["params"][group_order]]
        step = state.pop("step", None)
        try:
            set_states(opt, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    return set_main_param_and_optimizer_states


def create_missing_adam_state(optimizer: Any) -> None:
    """Give each parameter of a distributed optimizer's torch Adam without state the state of a fresh Adam (step 0,
    zero moments), so that megatron can build the load request (see the module docstring)."""
    for opt in parts(optimizer):
        inner = opt.optimizer
        if not _is_torch_adam(inner):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state[p]:
                    inner.state[p] = {
                        "step": torch.tensor(0.0),
                        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                    }


def _unshare_adam_steps(optimizer: Any) -> None:
    """Give each parameter its own ``step`` tensor after megatron's ``load_state_dict`` handed them one shared
    tensor (see the module docstring)."""
    for opt in parts(optimizer):
        inner = opt.optimizer
        if not _is_torch_adam(inner):
            continue
        for state in inner.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def state_summary(optimizer: Any) -> dict[str, Any]:
    """What this rank's optimizer holds: the elements of its main weights and their dtypes (a distributed
    optimizer holds its 1/dp slice), for tests."""
    main = [p for opt in parts(optimizer) for group in opt.optimizer.param_groups for p in group["params"]]
    return {"numel": sum(p.numel() for p in main), "dtypes": sorted({str(p.dtype) for p in main})}


def _is_torch_adam(inner: Any) -> bool:
    return isinstance(inner, torch.optim.Adam | torch.optim.AdamW)


__all__ = [
    "DTYPES",
    "TrainingState",
    "build",
    "create_missing_adam_state",
    "distributed_checkpoint_metadata",
    "init_sgd_state",
    "load_distributed_state",
    "parts",
    "repair_group_index_map",
    "state_summary",
]
