"""``DTensorPolicyWorker``: one rank of the FSDP2 + DTensor training backend (seed 003).

Built on :class:`rlcore.training.worker_base.TrainingWorkerBase`, which owns
the contracts (alignment, the shared optimizer-step loop, the reference-model
swap); this class supplies the sharded model and how to run it:

- the (dp, tp) device mesh from the environment the worker group sets, and the
  model parallelised by :func:`rl_dtensor.parallelize.parallelize`;
- forwards in padded or packed layout (:mod:`rl_dtensor.inputs`) with logprobs
  and top-k from vocab-parallel logits (:mod:`rl_dtensor.vocab_parallel`);
- step hooks: counts and losses summed over the dp group (tp peers hold the
  same data), gradients summed by FSDP's reduce-scatter, the global norm over
  DTensor gradients (:mod:`rl_dtensor.grads`);
- refit export, checkpoints, and moving weights/optimizer state between
  devices;
- with ``model_head="value"`` (capability ``value_head``) a value model: Hugging Face's token-classification
  model with one label, its head replicated over tp (:func:`rl_dtensor.tp_plans.value_model_plan`), values from
  the same padded or packed forwards; no refit, no reference model.
- a vision-language model (capability ``image_inputs``, docs/vision.md): loaded with Hugging Face's image-text
  class, its tower sharded in FSDP units of its own, images fed by :class:`rlcore.training.vision.VisionForward`;
  ``policy.freeze_vision_tower`` keeps the tower out of the optimizer and out of refit. dp only, padded or
  packed micro-batches (packed rows get each sequence's 3D rotary positions; :mod:`rl_dtensor.checks` refuses
  the rest).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import resource
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from rl_dtensor import state
from rl_dtensor.checks import check_context_parallel, check_vision_settings
from rl_dtensor.config import dtensor_section
from rl_dtensor.grads import clip_grads
from rl_dtensor.inputs import ModelInputs, forward_kwargs, packed_inputs, padded_inputs
from rl_dtensor.loading import load_sharded_model
from rl_dtensor.parallelize import DTYPES, ParallelOptions, build_mesh
from rlcore.data import BatchedDataDict
from rlcore.refit import RefitExportMixin
from rlcore.refit.buckets import dtype_name
from rlcore.training import lora, moe_aux
from rlcore.training import sharded_checkpoint as ckpt
from rlcore.training.checkpoint import is_adapter_checkpoint, save_tokenizer
from rlcore.training.checkpoint_files import check_inside
from rlcore.training.hf_config import load_config
from rlcore.training.hf_names import CheckpointNames
from rlcore.training.loop import StepHooks
from rlcore.training.process_group import init_distributed
from rlcore.training.value_head import check_model_head, load_value_model
from rlcore.training.vision import VisionForward, is_vision_language, under, vision_tower_path
from rlcore.training.worker_base import TrainingWorkerBase

# Gathering FSDP x TP shards (``full_tensor``) takes two all-gathers and DTensor warns about it on
# every call; it is expected here (refit and checkpoint gathers), so keep the logs readable.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


class DTensorPolicyWorker(RefitExportMixin, TrainingWorkerBase):
    """One rank: a Hugging Face causal LM sharded with FSDP2 over dp and DTensor TP over tp."""

    def __init__(
        self,
        config: Any,
        tokenizer: Any = None,
        *,
        weights_path: str | None = None,
        optimizer_path: str | None = None,
        init_optimizer: bool = True,
        init_reference_model: bool = True,
        backend_config: Any = None,
        layout: Any = None,
        model_head: str = "lm",
    ) -> None:
        # backend_config is policy.dtensor_cfg (rl_dtensor.config) and layout its tp/cp (rl_dtensor.layout).
        from rlcore.config import as_policy_config

        config = as_policy_config(config)  # the seed's plain dict is accepted too
        dcfg = dtensor_section(config, backend_config)
        self.model_head = check_model_head(model_head)
        if self.model_head == "value" and config.lora.enabled:
            raise ValueError(
                "policy.lora.enabled: the dtensor backend trains a value model's weights in full (no LoRA "
                "adapters on a value model); set policy.lora.enabled=false in the value model's section"
            )
        self.cfg = config
        self.tokenizer = tokenizer
        self.device = init_distributed()
        self.rank = dist.get_rank()
        check_context_parallel(dcfg.context_parallel_size, self.device)
        self.tp_size = dcfg.tensor_parallel_size
        world = dist.get_world_size()
        if world % self.tp_size:
            raise ValueError(
                f"policy.dtensor_cfg.tensor_parallel_size={self.tp_size} does not divide the world size {world}"
            )
        self.dp_size = world // self.tp_size
        self.mesh = build_mesh(self.device.type, self.dp_size, self.tp_size)
        self.dp_group = self.mesh["dp"].get_group()
        self.opts = dataclasses.replace(
            ParallelOptions.from_config(config, dcfg), value_model=self.model_head == "value"
        )
        self.reduce_grads_per_step = dcfg.reduce_grads == "per_step"
        self.compute_dtype = DTYPES[config.precision]
        # Sequence parallel splits the sequence over tp ranks: widths must be multiples of tp; and of
        # policy.make_sequence_length_divisible_by (packed rows too; padded micro-batches already are).
        sp_multiple = self.tp_size if (self.tp_size > 1 and self.opts.sequence_parallel) else 1
        self.seq_multiple = math.lcm(sp_multiple, config.make_sequence_length_divisible_by)

        # Float32 master weights whatever the precision; ``precision`` is FSDP's compute dtype.
        # A LoRA checkpoint holds only the adapters: the base weights come from the model itself.
        if weights_path:
            check_inside(weights_path)  # a checkpoint reads its own files only
        adapter_path = weights_path if is_adapter_checkpoint(weights_path) else None
        base_path = config.model_name if adapter_path else (weights_path or config.model_name)
        check_vision_settings(load_config(base_path, config.hf_config_overrides), config, self.tp_size, model_head)
        # Each rank allocates only its shards; rank 0 reads the checkpoint and broadcasts it.
        self.model: nn.Module
        self.model, self.lora_targets = load_sharded_model(
            base_path,
            config.lora,
            adapter_path,
            self.mesh,
            self.opts,
            self.device,
            config.hf_config_overrides,
            freeze_vision=config.freeze_vision_tower,
        )
        self.hf_config = self.model.config
        # A vision-language model: images in the forwards; a frozen tower stays out of refit.
        packing = bool(config.sequence_packing.enabled)
        self.vision = VisionForward(self.model, packing) if is_vision_language(self.hf_config) else None
        self.frozen_tower = vision_tower_path(self.model) if config.freeze_vision_tower else None
        # A mixture-of-experts' load-balancing loss, trained when its config asks (rlcore.training.moe_aux).
        self.aux_coef = moe_aux.aux_coefficient(self.hf_config)
        self._routers = moe_aux.RouterLogitsRecorder(self.model) if self.aux_coef else None
        self._training_forward = False
        self._pending_aux: moe_aux.AuxLoss | None = None
        # Refit and checkpoints use the checkpoint's names (a MoE's fused experts: per expert again).
        self.checkpoint_names = CheckpointNames(self.model)
        self._mode = "plain"
        # Where weights and optimizer state are now (offloading moves them to CPU between phases).
        self._model_device = self.device
        self._optimizer_device = self.device

        # Frozen base weights (LoRA) get no optimizer state.
        self._init_optimizer_and_reference(
            [p for p in self.model.parameters() if p.requires_grad],
            init_optimizer=init_optimizer,
            optimizer_path=optimizer_path,
            init_reference_model=init_reference_model,
            load_optimizer=lambda path: ckpt.load_optimizer(self.model, self.optimizer, self.scheduler, path),
        )

    def __repr__(self) -> str:
        return (
            f"DTensorPolicyWorker(rank={getattr(self, 'rank', '?')}, dp={getattr(self, 'dp_size', '?')}, "
            f"tp={getattr(self, 'tp_size', '?')})"
        )

    # -- model passes ----------------------------------------------------------------
    def _inputs(self, mb: BatchedDataDict) -> ModelInputs:
        if self._mode == "packing":
            return packed_inputs(
                mb, self.device, self.hf_config._attn_implementation, self.compute_dtype, self.seq_multiple
            )
        return padded_inputs(mb, self.device, self.seq_multiple)

    def _run(self, mb: BatchedDataDict) -> tuple[ModelInputs, torch.Tensor]:
        inputs = self._inputs(mb)
        if not (self._routers and self._training_forward):
            return inputs, self.model(**forward_kwargs(inputs, mb, self.vision)).logits
        with self._routers.recording() as router_logits:
            logits = self.model(**forward_kwargs(inputs, mb, self.vision)).logits
        mask = inputs.routed_mask(mb["sample_mask"])
        aux = moe_aux.load_balancing_loss(router_logits, mask, self.hf_config.num_experts_per_tok)
        self._pending_aux = moe_aux.AuxLoss(aux, float(moe_aux.routed_tokens(mb)), self.aux_coef)  # host count
        return inputs, logits

    def _take_aux(self) -> moe_aux.AuxLoss | None:
        """The aux loss of the training forward that just ran (the loop adds it to that micro-batch's loss)."""
        aux, self._pending_aux = self._pending_aux, None
        return aux

    def _forward_logprobs(self, mb: BatchedDataDict) -> torch.Tensor:
        inputs, logits = self._run(mb)
        # rollouts were sampled from softmax(logits / T)
        return inputs.logprobs(logits, self.logprob_temperature, self.cfg.logprob_chunk_size)

    def _forward_values(self, mb: BatchedDataDict) -> torch.Tensor:
        inputs, head_out = self._run(mb)  # a value model's "logits" are its head's [B', W, 1] outputs
        return inputs.values(head_out)

    def _forward_topk(self, mb: BatchedDataDict, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, logits = self._run(mb)
        return inputs.topk(logits, k)

    def _forward_with_inputs(self, mb: BatchedDataDict, names: tuple[str, ...]) -> tuple[torch.Tensor, dict]:
        """One forward: the logprobs and the loss inputs ``names`` (:mod:`rlcore.training.loss_inputs`)."""
        inputs, logits = self._run(mb)
        logprobs = inputs.logprobs(logits, self.logprob_temperature, self.cfg.logprob_chunk_size)
        return logprobs, {name: inputs.loss_input(name, logits, mb) for name in names}

    # The base class passes the micro-batching mode to these two; remember it for _inputs.
    def _map_micro_batches(self, data, fn, micro_batch_size, mode):
        self._mode = mode
        self._ensure_on_device(optimizer=False)
        try:
            return super()._map_micro_batches(data, fn, micro_batch_size, mode)
        finally:
            self._release_gathered()

    def _release_gathered(self) -> None:
        """Without ``reshard_after_forward`` a pass with no backward leaves every unit gathered: free them."""
        if not self.opts.reshard_after_forward:
            state.reshard(self.model)

    def _fsdp_modules(self) -> list:
        if not hasattr(self, "_fsdp_units"):
            self._fsdp_units = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        return self._fsdp_units

    def _before_micro_batch(self, last: bool) -> None:
        """FSDP2 told whether this training micro-batch is the step's last: only its backward reduce-scatters the
        summed gradients (``reduce_grads: per_step``) and reshards the parameters (no ``reshard_after_forward``)."""
        for unit in self._fsdp_modules():
            if self.reduce_grads_per_step:
                unit.set_requires_gradient_sync(last, recurse=False)
            if not self.opts.reshard_after_forward:
                unit.set_reshard_after_backward(last, recurse=False)

    def _ensure_on_device(self, optimizer: bool) -> None:
        """Bring offloaded weights (and optimizer state) back before a pass that needs them."""
        if self._model_device != self.device:
            self.move_to_device(self.model, self.device)
        if optimizer:
            self._optimizer_to(self.device)

    def train(
        self,
        data: BatchedDataDict,
        loss_fn: Any,
        eval_mode: bool = False,
        gbs: int | None = None,
        mbs: int | None = None,
        mode: str = "plain",
    ) -> dict[str, Any]:
        self._mode = mode
        self._ensure_on_device(optimizer=not eval_mode)
        self._training_forward = True
        try:
            return super().train(data, loss_fn, eval_mode=eval_mode, gbs=gbs, mbs=mbs, mode=mode)
        finally:
            self._training_forward = False
            self._release_gathered()

    def _step_hooks(self) -> StepHooks:
        return StepHooks(
            forward=self._forward_logprobs,
            forward_with_inputs=self._forward_with_inputs,
            # Over dp only: tp peers hold the same data and compute the same values.
            all_reduce_sum=lambda t: self._all_reduce_sum(t, self.dp_group),
            finish_grads=lambda: None,  # FSDP2 reduce-scattered (summed) the gradients during backward
            clip_grads=lambda max_norm: clip_grads(self.model.parameters(), max_norm, self.device),
            optimizer_step=self._optimizer_step,
            zero_grad=lambda: self.model.zero_grad(set_to_none=True),
            before_micro_batch=self._before_micro_batch,
            model_aux_loss=self._take_aux if self._routers else None,
        )

    # -- reference model: this rank's own shards on CPU (LoRA: the base class switches adapters off) ------
    def _snapshot_to_cpu(self) -> dict[str, torch.Tensor]:
        return state.snapshot_local(self.model)

    def _load_snapshot(self, snapshot: dict[str, torch.Tensor]) -> None:
        state.restore_local(self.model, snapshot)

    # -- refit export (RefitExportMixin builds the transports on these two) ---------------
    def _refit_dtype(self) -> torch.dtype:
        return self.compute_dtype

    def prepare_refit_info(self, changed_only: bool = False) -> dict[str, tuple[tuple[int, ...], str]]:
        """``{hf_name: (full shape, dtype)}`` in :meth:`iter_refit_tensors` order; no communication."""
        self._refuse_on_value_model("prepare_refit_info")
        dtype = dtype_name(self._refit_dtype())
        keep = self._refit_keep()
        info = {name: (shape, dtype) for name, shape in state.full_shapes(self.model).items() if keep(name)}
        if self.lora_targets:
            info = lora.merged_metadata(info, self._changed_layers(changed_only))
        shapes = self.checkpoint_names.shapes({name: shape for name, (shape, _) in info.items()})
        return {name: (shape, dtype) for name, shape in shapes.items()}

    def _refit_keep(self) -> Callable[[str], bool]:
        """Which in-memory names refit sends: all but a frozen vision tower's (the engine keeps what it loaded)."""
        return lambda name: not under(self.frozen_tower, name)

    def iter_refit_tensors(self, changed_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors (LoRA: merged); every rank must iterate (gathering shards is a collective)."""
        self._refuse_on_value_model("refit")
        self._ensure_on_device(optimizer=False)
        state.reshard(self.model)
        dtype = self._refit_dtype()
        if not self.lora_targets:
            yield from self.checkpoint_names.tensors(state.iter_full_tensors(self.model, dtype, self._refit_keep()))
            return
        only = self._changed_layers(changed_only)
        keep = None if only is None else (lambda name: lora.layer_path(name) in only)
        merged = lora.merge_stream(state.iter_full_tensors(self.model, keep=keep), self.cfg.lora.scaling, only)
        yield from self.checkpoint_names.tensors((name, t.to(dtype)) for name, t in merged)

    # -- checkpoints ------------------------------------------------------------------------
    def save_checkpoint(
        self, weights_path: str, optimizer_path: str | None = None, tokenizer_path: str | None = None
    ) -> None:
        """HF safetensors (rank 0 writes the gathered tensors) and DCP optimizer state; each atomic."""
        self._ensure_on_device(optimizer=bool(optimizer_path))
        if self.lora_targets:
            self._save_lora(weights_path, merged=self.cfg.lora.save_merged)
        else:
            state.reshard(self.model)
            tensors = self.checkpoint_names.tensors(state.iter_full_tensors(self.model))
            ckpt.save_gathered(tensors, self.hf_config, weights_path)
        if tokenizer_path and self.tokenizer is not None:
            ckpt.on_rank0(lambda: save_tokenizer(self.tokenizer, tokenizer_path))
        if optimizer_path and self.optimizer is not None:
            ckpt.save_optimizer(self.model, self.optimizer, self.scheduler, optimizer_path)

    def save_lora_adapter(self, path: str) -> None:
        """The adapters alone in PEFT's format (an adapter refit). Collective; rank 0 writes."""
        self._ensure_on_device(optimizer=False)
        self._save_lora(path, merged=False)

    def _save_lora(self, weights_path: str, merged: bool) -> None:
        """The adapters in PEFT's format; with ``merged`` the merged model under ``merged/``."""
        state.reshard(self.model)
        on_rank0 = self.rank == 0  # every rank takes part in the gathers; rank 0 keeps and writes
        adapters = {
            name: t.to("cpu", copy=True)
            for name, t in state.iter_full_tensors(self.model, keep=lora.is_adapter_name)
            if on_rank0
        }
        full = None
        if merged:
            full = {
                name: t.to("cpu", copy=True)
                for name, t in self.checkpoint_names.tensors(
                    lora.merge_stream(state.iter_full_tensors(self.model), self.cfg.lora.scaling)
                )
                if on_rank0
            }
        config = lora.peft_adapter_config(self.cfg.lora, self.lora_targets, self.cfg.model_name)
        ckpt.on_rank0(lambda: lora.save_lora_checkpoint(adapters, config, weights_path, full, self.hf_config))

    def load_checkpoint(self, weights_path: str, optimizer_path: str | None = None) -> None:
        self._ensure_on_device(optimizer=bool(optimizer_path))
        if is_adapter_checkpoint(weights_path):
            state.load_full_state_dict(self.model, lora.load_adapter(weights_path), only=lora.is_adapter_name)
        else:
            state.load_full_state_dict(self.model, self._full_state_of(weights_path))
        if optimizer_path and self.optimizer is not None:
            ckpt.load_optimizer(self.model, self.optimizer, self.scheduler, optimizer_path)

    def _full_state_of(self, weights_path: str) -> dict[str, torch.Tensor]:
        """A checkpoint's tensors under the model's in-memory names (:meth:`CheckpointNames.read`). A value model
        reads through :func:`rlcore.training.value_head.load_value_model` (a causal LM's weights get a fresh head)."""
        if self.model_head == "value":
            check_inside(weights_path)  # a checkpoint reads its own files only
            return load_value_model(weights_path, copy.deepcopy(self.hf_config)).state_dict()
        return self.checkpoint_names.read(weights_path, self.hf_config)

    # -- lifecycle and memory ----------------------------------------------------------------
    def _optimizer_to(self, device: torch.device | str) -> None:
        device = torch.device(device)
        if self.optimizer is None or self._optimizer_device == device:
            return
        self._optimizer_device = device
        for per_param in self.optimizer.state.values():
            for key, value in per_param.items():
                if isinstance(value, torch.Tensor) and key != "step":
                    per_param[key] = value.to(device, non_blocking=True)
        if device.type == "cpu" and torch.cuda.is_available():
            torch.cuda.synchronize()  # asynchronous copies to the host: complete before anyone reads them

    def move_to_device(self, model: nn.Module, device: str | torch.device) -> nn.Module:
        """Move parameters (shards) and buffers; FSDP2 re-registers its shards after ``.to``."""
        device = torch.device(device)
        if self.opts.cpu_offload:
            return model  # FSDP's CPUOffloadPolicy owns where parameters live
        state.reshard(model)
        model = model.to(device)
        if model is self.model:
            self._model_device = device
        return model

    def move_buffer_to_device(self, model: nn.Module, device: str | torch.device) -> nn.Module:
        for module in model.modules():
            for name, buf in list(module._buffers.items()):
                if buf is not None:
                    module._buffers[name] = buf.to(device)
        return model

    def move_to_cuda(self, model: nn.Module) -> nn.Module:
        if not torch.cuda.is_available():
            raise RuntimeError("move_to_cuda: no CUDA device in this worker")
        return self.move_to_device(model, self.device)

    def move_to_cpu(self, model: nn.Module) -> nn.Module:
        return self.move_to_device(model, "cpu")

    def prepare_for_training(self, *args: Any, **kwargs: Any) -> None:
        self.move_to_device(self.model, self.device)
        self._optimizer_to(self.device)
        self.model.train()

    def prepare_for_lp_inference(self) -> None:
        self.move_to_device(self.model, self.device)
        self.model.eval()
        self.offload_before_refit()  # the optimizer state is not needed for logprobs

    def offload_before_refit(self) -> None:
        """Free accelerator memory for generation: optimizer state to CPU."""
        if self.device.type == "cuda":
            self._optimizer_to("cpu")
            torch.cuda.empty_cache()

    def offload_after_refit(self) -> None:
        """After the weights were sent: the model goes to CPU as well."""
        if self.device.type == "cuda":
            self.move_to_cpu(self.model)
            self._optimizer_to("cpu")
            torch.cuda.empty_cache()

    def get_gpu_info(self) -> dict[str, Any]:
        info = super().get_gpu_info()
        info.update(
            dp=self.dp_size,
            tp=self.tp_size,
            dp_rank=self.mesh["dp"].get_local_rank(),
            tp_rank=self.mesh["tp"].get_local_rank(),
            max_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        )
        if self.device.type == "cuda":
            info["device_name"] = torch.cuda.get_device_name(self.device)
            info["device_uuid"] = str(torch.cuda.get_device_properties(self.device).uuid)
        return info

    # -- test helpers ----------------------------------------------------------------------
    def state_dict_cpu(self) -> dict[str, torch.Tensor]:
        """Full float32 tensors on CPU (rank 0's copy is the meaningful one). Collective."""
        self._ensure_on_device(optimizer=False)
        state.reshard(self.model)
        return {name: t.to("cpu", copy=True) for name, t in state.iter_full_tensors(self.model)}

    def parameter_checksum(self) -> float:
        """Sum of this rank's parameter shards in float64 (weights (un)changed, without communication)."""
        state.reshard(self.model)  # the root group may still hold gathered parameters after a forward
        return float(sum(state.local_tensor(p).detach().double().sum() for p in self.model.parameters()))

    def optimizer_summary(self) -> dict[str, Any]:
        """Learning rates, step counts and a checksum of this rank's optimizer-state shards."""
        steps, moments = set(), 0.0
        for per_param in self.optimizer.state.values():
            for key, value in per_param.items():
                if key == "step":
                    steps.add(int(value))
                elif isinstance(value, torch.Tensor):
                    moments += float(state.local_tensor(value).double().abs().sum())
        return {"lr": [g["lr"] for g in self.optimizer.param_groups], "steps": sorted(steps), "moments": moments}

    def is_dtensor_model(self) -> dict[str, int]:
        """How many parameters are DTensors, and on how many mesh dimensions (tests check the layout)."""
        dims: dict[str, int] = {}
        state.reshard(self.model)
        for name, p in self.model.named_parameters():
            dims[name] = p.device_mesh.ndim if isinstance(p, DTensor) else 0
        return dims
