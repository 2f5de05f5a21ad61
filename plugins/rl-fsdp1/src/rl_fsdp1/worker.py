"""``FSDP1PolicyWorker``: one rank of the ``fsdp1`` training backend (seed 004 surface).

Data parallel only: every rank holds a 1/dp shard of each FSDP unit (one per
decoder layer, plus the root with embeddings/norm/head). The shared parts
(micro-batching, loss normalisation, the optimizer-step loop, padding the
results, the reference-model swap) come from
:class:`rlcore.training.worker_base.TrainingWorkerBase`; this module adds what
is FSDP1-specific:

- gradients: FSDP1 *averages* over ranks in its reduce-scatter, while rlcore
  sums (losses are normalised by global counts, design.md §2.3), so
  ``finish_grads`` multiplies the reduced shards by dp;
- the gradient norm is reduced over the shards of all ranks;
- the reference model and the offload hooks move the flat parameter shards;
- full HF-named tensors for refit and checkpoints are gathered one unit at a
  time (:mod:`rl_fsdp1.sharding`); the refit transports (shared-memory
  streaming, collective broadcast) come from ``rlcore.refit.RefitExportMixin``
  on top of ``prepare_refit_info`` / ``iter_refit_tensors``;
- ``generate`` runs HF ``generate`` on the plain model inside
  ``summon_full_params`` (:mod:`rl_fsdp1.generation`);
- a vision-language model (capability ``image_inputs``, docs/vision.md): Hugging Face's image-text class, its
  tower one FSDP unit, images fed by :class:`rlcore.training.vision.VisionForward` (and to ``generate``);
  ``policy.freeze_vision_tower`` freezes the tower's flat parameters and keeps them out of refit.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from rl_fsdp1 import generation as gen
from rl_fsdp1.sharding import (
    DTYPES,
    ParamLayout,
    apply_activation_checkpointing,
    fsdp_kwargs,
    release_gathered_params,
    repoint_unsharded_views,
    unwrapped_view,
)
from rlcore.data import BatchedDataDict
from rlcore.refit import RefitExportMixin
from rlcore.refit.buckets import dtype_name
from rlcore.training import lora
from rlcore.training import sharded_checkpoint as ckpt
from rlcore.training.checkpoint import is_adapter_checkpoint, recover_checkpoint, save_tokenizer
from rlcore.training.checkpoint_files import check_inside
from rlcore.training.hf_names import CheckpointNames
from rlcore.training.loop import StepHooks
from rlcore.training.process_group import init_distributed
from rlcore.training.vision import (
    VisionForward,
    check_unsupported,
    freeze_vision_tower,
    is_vision_language,
    under,
)
from rlcore.training.worker_base import TrainingWorkerBase

logger = logging.getLogger(__name__)


class FSDP1PolicyWorker(RefitExportMixin, TrainingWorkerBase):
    """One rank of the ``fsdp1`` backend."""

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
    ) -> None:
        # Plugin API 2: fsdp1 has no section and no layout function (backend_config None, pure dp).
        from rlcore.config import as_policy_config
        from rlcore.training.hf_config import pretrained_model
        from rlcore.training.moe_aux import aux_coefficient

        config = as_policy_config(config)  # the seed's plain dict is accepted too
        self.device = init_distributed()
        self.cfg = config
        self.tokenizer = tokenizer
        self.rank = dist.get_rank()
        self.dp_size = dist.get_world_size()
        self.export_dtype = DTYPES[config.precision]

        # Master weights in float32 (FSDP mixed precision casts for compute); every rank reads the
        # checkpoint itself, so no broadcast of module states is needed. A LoRA checkpoint holds only
        # the adapters: the base weights come from the model itself.
        if weights_path:
            check_inside(weights_path)  # a checkpoint reads its own files only
        adapter_path = weights_path if is_adapter_checkpoint(weights_path) else None
        base_path = config.model_name if adapter_path else (weights_path or config.model_name)
        hf_model = pretrained_model(base_path, config.hf_config_overrides, dtype=torch.float32)
        self.hf_config = hf_model.config
        if aux_coefficient(self.hf_config):
            raise ValueError(
                "policy.hf_config_overrides.output_router_logits: the model's config asks for the router "
                "load-balancing loss (output_router_logits true), which the fsdp1 backend does not train; set "
                "policy.hf_config_overrides.output_router_logits=false, or train with the dtensor backend"
            )
        check_unsupported(
            self.hf_config,
            {"policy.lora.enabled": config.lora.enabled},
            "fsdp1",
            {"policy.lora.enabled": "set it to false"},
        )
        self.lora_targets = lora.apply_lora(hf_model, config.lora) if config.lora.enabled else []
        if adapter_path:
            lora.load_adapter_into(hf_model, adapter_path)
        # A vision-language model: images in the forwards (before wrapping: the hook finds the plain modules);
        # a frozen tower is frozen before FSDP flattens it, and stays out of refit.
        self.vision = VisionForward(hf_model) if is_vision_language(self.hf_config) else None
        self.frozen_tower = freeze_vision_tower(hf_model) if config.freeze_vision_tower else None
        # Refit and checkpoints speak the checkpoint's names (a VLM's ``visual.*``, ``model.layers.*``).
        self.checkpoint_names = CheckpointNames(hf_model)
        self.layout = ParamLayout.from_model(hf_model)
        kwargs, self.notes = fsdp_kwargs(hf_model, self.device, config.precision, config.fsdp_offload_enabled)
        for note in self.notes:
            logger.warning(note)
        self.fsdp_offload = kwargs["cpu_offload"] is not None
        self.model = FSDP(hf_model, **kwargs)
        if config.activation_checkpointing_enabled:
            apply_activation_checkpointing(self.model)
        self.layout.bind(self.model)
        self._model_on_device = True

        # Frozen base weights (LoRA) get no optimizer state: only the adapter units' flat shards train.
        self._init_optimizer_and_reference(
            [p for p in self.model.parameters() if p.requires_grad],
            init_optimizer=init_optimizer,
            optimizer_path=optimizer_path,
            init_reference_model=init_reference_model,
            load_optimizer=lambda path: ckpt.load_optimizer(self.model, self.optimizer, self.scheduler, path),
        )

    def __repr__(self) -> str:
        return f"FSDP1PolicyWorker(rank={getattr(self, 'rank', '?')}, device={getattr(self, 'device', '?')})"

    # -- gradients (the forwards are TrainingWorkerBase's: FSDP wraps a whole HF model) ----
    def _grad_norm(self, max_norm: float | None) -> float:
        """Global L2 norm of the gradient shards of all ranks; clip like ``clip_grad_norm_`` when asked."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        local = sum((g.detach().double().square().sum() for g in grads), torch.zeros((), dtype=torch.float64))
        total = local.to(self.device)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        norm = float(total.sqrt())
        if max_norm is not None and norm == norm and norm != float("inf"):
            coef = float(max_norm) / (norm + 1e-6)
            if coef < 1.0:
                for g in grads:
                    g.detach().mul_(coef)
        return norm

    def _step_hooks(self) -> StepHooks:
        self._ensure_on_device(optimizer=True)
        params = list(self.model.parameters())

        def finish_grads() -> None:
            # FSDP1 divided by the world size around its reduce-scatter; rlcore sums over ranks.
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(self.dp_size)

        return StepHooks(
            forward=self._forward_logprobs,
            forward_with_inputs=self._forward_with_inputs,
            all_reduce_sum=self._all_reduce_sum,
            finish_grads=finish_grads,
            clip_grads=self._grad_norm,
            optimizer_step=self._optimizer_step,
            zero_grad=lambda: self.model.zero_grad(set_to_none=True),
            run_micro_batches=self._run_offloaded_micro_batches if self.fsdp_offload else None,
        )

    def _run_offloaded_micro_batches(
        self, mbs: list[BatchedDataDict], loss_of: Callable[..., torch.Tensor], eval_mode: bool
    ) -> None:
        """Forward and backward every micro-batch, summing the gradients here.

        With CPU offload, FSDP1 copies each backward's gradient over the previous one in its
        CPU buffer instead of adding to it (a limitation torch notes in
        ``FlatParamHandle.prepare_gradient_for_backward``): left to FSDP, a step would train on
        its last micro-batch only. So each micro-batch's CPU gradient is added to a sum kept
        here, and the sum becomes ``.grad`` for the optimizer.
        """
        sums: dict[torch.nn.Parameter, torch.Tensor] = {}
        for mb in mbs:
            loss = loss_of(mb, self._forward_logprobs(mb))
            if eval_mode:
                continue
            loss.backward()
            for p in self.model.parameters():
                if p.grad is None:
                    continue
                if p in sums:
                    sums[p].add_(p.grad)
                else:
                    sums[p] = p.grad.detach().clone()  # FSDP reuses its buffer at the next backward
                p.grad = None
        for p, grad in sums.items():
            p.grad = grad
        self._free_offloaded_copies()

    def _free_offloaded_copies(self) -> None:
        """With FSDP1's CPU offload on one rank, free the GPU copy of the weights a pass left behind.

        One rank is ``NO_SHARD``: a pass copies each flat parameter to the GPU and points the
        module weights at that copy; FSDP1 then points the flat parameter back at its CPU
        storage but not the module weights, so the copy stayed allocated between passes
        (measured on an H200: the same GPU bytes with offload as without). Pointing the
        weights at the CPU storage again frees it; the next pass re-points them itself.
        """
        if self.fsdp_offload:
            repoint_unsharded_views(self.model)

    def get_logprobs(
        self, data: BatchedDataDict, micro_batch_size: int | None = None, mode: str = "plain"
    ) -> BatchedDataDict:
        self._ensure_on_device()
        try:
            return super().get_logprobs(data, micro_batch_size, mode)
        finally:
            self._free_offloaded_copies()

    def get_topk_logits(
        self, data: BatchedDataDict, k: int, micro_batch_size: int | None = None, mode: str = "plain"
    ) -> BatchedDataDict:
        self._ensure_on_device()
        try:
            return super().get_topk_logits(data, k, micro_batch_size, mode)
        finally:
            self._free_offloaded_copies()

    # -- reference model: the rank's own flat shards ------------------------------------
    def _snapshot_to_cpu(self) -> dict[str, torch.Tensor]:
        """CPU copy of this rank's flat parameter shards (no gathering; costs 1/dp of the model)."""
        return {n: p.detach().to("cpu", copy=True) for n, p in self.model.named_parameters()}

    def _load_snapshot(self, state: dict[str, torch.Tensor]) -> None:
        release_gathered_params(self.model)  # or the next forward would reuse the root's stale gathered copy
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(state[name])

    # -- generation ---------------------------------------------------------------------
    def generate(self, data: BatchedDataDict, greedy: bool = False) -> BatchedDataDict:
        """HF ``generate`` on the gathered full parameters; returns ``GenerationOutputSpec`` fields.

        Collective (the gather): every rank calls it, each with its own shard of prompts.
        """
        from rlcore.config.generation import GenerationConfig

        gen_cfg = self.cfg.generation or GenerationConfig()
        settings = gen.SamplingSettings.from_config(gen_cfg, self.tokenizer, greedy)
        self._ensure_on_device()
        was_training = self.model.training
        self.model.eval()
        autocast = (
            torch.autocast(self.device.type, dtype=self.export_dtype)
            if self.export_dtype != torch.float32
            else contextlib.nullcontext()
        )
        try:
            with (
                torch.no_grad(),
                FSDP.summon_full_params(self.model, writeback=False),
                unwrapped_view(self.model) as plain,
                autocast,
            ):
                out = gen.generate_in_batches(
                    plain,
                    data,
                    settings,
                    self.tokenizer,
                    gen_cfg.stop_strings,
                    self.device,
                    self.cfg.generation_batch_size,
                )
        finally:
            self.model.train(was_training)
            self._free_offloaded_copies()
        return BatchedDataDict(out)

    # -- refit export ------------------------------------------------------------------
    def prepare_refit_info(self, changed_only: bool = False) -> dict[str, tuple[tuple[int, ...], str]]:
        """``{hf_name: (shape, dtype)}`` in the order :meth:`iter_refit_tensors` yields them."""
        info = {
            n: (self.layout.shapes[n], dtype_name(self._export_dtype(self.layout.dtypes[n])))
            for n in self._refit_names()
        }
        if self.lora_targets:
            return lora.merged_metadata(info, self._changed_layers(changed_only))
        if not self.checkpoint_names.converts:
            return info
        metas = ((n, torch.empty(self.layout.shapes[n], dtype=self.layout.dtypes[n], device="meta")) for n in info)
        return {
            name: (tuple(t.shape), dtype_name(self._export_dtype(t.dtype)))
            for name, t in self.checkpoint_names.tensors(metas)
        }

    def _refit_names(self) -> list[str]:
        """The in-memory names refit sends: all but a frozen vision tower's (the engine keeps what it loaded)."""
        return [n for n in self.layout.names if not under(self.frozen_tower, n)]

    def _export_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.export_dtype if dtype.is_floating_point else dtype

    def iter_refit_tensors(self, changed_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, full tensor)`` in ``prepare_refit_info`` order, in the compute dtype.

        Collective: every rank must iterate to the end. Each tensor is a fresh
        copy on this rank's device, owned by the caller.
        """
        self._ensure_on_device()
        for name, tensor in self._hf_tensors(self._changed_layers(changed_only), self._refit_names()):
            yield name, tensor.to(device=self.device, dtype=self._export_dtype(tensor.dtype), copy=True)

    def _hf_tensors(
        self, only_layers: set[str] | None = None, names: list[str] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Full Hugging Face tensors under the checkpoint's names, one unit gathered at a time (``names``: only
        these in-memory ones); with LoRA the adapted layers merged."""
        if not self.lora_targets:
            yield from self.checkpoint_names.tensors(self.layout.iter_full(self.model, names))
            return
        names = [n for n in self.layout.names if only_layers is None or lora.layer_path(n) in only_layers]
        # merge_stream holds a layer's base weight until its adapters (other FSDP units) have passed:
        # copy it out of the gathered storage, which is freed when the next unit is gathered.
        copies = ((name, t.clone()) for name, t in self.layout.iter_full(self.model, names))
        yield from lora.merge_stream(copies, self.cfg.lora.scaling, only_layers)

    def export_full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Full float32 HF state dict on rank 0 (CPU; LoRA: merged), None elsewhere. Collective."""
        self._ensure_on_device()
        state = {}
        for name, tensor in self._hf_tensors():
            if self.rank == 0:
                state[name] = tensor.to("cpu", copy=True)
        return state if self.rank == 0 else None

    # -- memory movement ----------------------------------------------------------------
    def manual_offload_to_cpu(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move the model's flat parameter shards and buffers to CPU (no-op with FSDP CPU offload / on CPU)."""
        release_gathered_params(model)
        if not self.fsdp_offload:
            _move_module(model, torch.device("cpu"))
        return model

    def manual_load_to_gpu(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move them back to this rank's device."""
        release_gathered_params(model)
        if not self.fsdp_offload:
            _move_module(model, self.device)
        return model

    def _move_optimizer_state(self, device: torch.device) -> None:
        if self.optimizer is None or self.fsdp_offload:
            return
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and key != "step":
                    state[key] = value.to(device)

    def _ensure_on_device(self, optimizer: bool = False) -> None:
        if not self._model_on_device:
            self.manual_load_to_gpu(self.model)
            self._model_on_device = True
        if optimizer:
            self._move_optimizer_state(self.device)

    def _empty_cache(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def prepare_for_training(self, *args: Any, **kwargs: Any) -> None:
        self._ensure_on_device(optimizer=True)
        self.model.train()

    def prepare_for_lp_inference(self) -> None:
        self._ensure_on_device()
        self.model.eval()
        self._move_optimizer_state(torch.device("cpu"))
        self._empty_cache()

    def offload_before_refit(self) -> None:
        """Free accelerator memory the refit does not need: the optimizer state and cached gathered parameters."""
        release_gathered_params(self.model)
        self._move_optimizer_state(torch.device("cpu"))
        self._empty_cache()

    def offload_after_refit(self) -> None:
        """After the weights went to the generation engine: everything to CPU until training resumes."""
        self.manual_offload_to_cpu(self.model)
        self._model_on_device = self.device.type == "cpu"
        self._move_optimizer_state(torch.device("cpu"))
        self._empty_cache()

    # -- checkpoints -------------------------------------------------------------------
    def save_checkpoint(
        self, weights_path: str, optimizer_path: str | None = None, tokenizer_path: str | None = None
    ) -> None:
        """HF safetensors (float32) written by rank 0 as it gathers them; DCP optimizer state; tokenizer.

        Collective, and each part atomic. No rank holds the full model or the
        full optimizer state: weights are gathered one FSDP unit at a time and
        written as they come; each rank writes its own optimizer shards, which
        load at any data-parallel size (:mod:`rlcore.training.sharded_checkpoint`).
        """
        self._ensure_on_device(optimizer=bool(optimizer_path))
        if self.lora_targets:
            write_weights = self._gather_lora_weights(merged=self.cfg.lora.save_merged)
            ckpt.on_rank0(lambda: write_weights(weights_path))
        else:
            ckpt.save_gathered(self._hf_tensors(), self.hf_config, weights_path)
        if tokenizer_path and self.tokenizer is not None:
            ckpt.on_rank0(lambda: save_tokenizer(self.tokenizer, tokenizer_path))
        if optimizer_path and self.optimizer is not None:
            ckpt.save_optimizer(self.model, self.optimizer, self.scheduler, optimizer_path)

    def save_lora_adapter(self, path: str) -> None:
        """The adapters alone in PEFT's format (an adapter refit). Collective; rank 0 writes."""
        self._ensure_on_device()
        write = self._gather_lora_weights(merged=False)
        ckpt.on_rank0(lambda: write(path))

    def _gather_lora_weights(self, merged: bool) -> Callable[[str], None]:
        """Gather the adapters (collective; with ``merged`` the merged model too); rank 0 then writes
        them in PEFT's format with the returned function."""
        keep = self.rank == 0
        adapter_names = [n for n in self.layout.names if lora.is_adapter_name(n)]
        adapters = {n: t.to("cpu", copy=True) for n, t in self.layout.iter_full(self.model, adapter_names) if keep}
        full = self.export_full_state_dict() if merged else None
        config = lora.peft_adapter_config(self.cfg.lora, self.lora_targets, self.cfg.model_name)
        return lambda path: lora.save_lora_checkpoint(adapters, config, path, full, self.hf_config)

    def load_checkpoint(self, weights_path: str, optimizer_path: str | None = None) -> None:
        """Load HF safetensors or a LoRA adapter (and optionally the optimizer state). Collective."""
        if self.rank == 0:
            recover_checkpoint(weights_path)
        dist.barrier()
        self._ensure_on_device(optimizer=bool(optimizer_path))
        if is_adapter_checkpoint(weights_path):
            self.layout.load_full(self.model, lora.load_adapter(weights_path), only=lora.is_adapter_name)
        else:
            self.layout.load_full(self.model, self.checkpoint_names.read(weights_path, self.hf_config))
        if optimizer_path and self.optimizer is not None:
            ckpt.load_optimizer(self.model, self.optimizer, self.scheduler, optimizer_path)

    # -- test and debug helpers -----------------------------------------------------------
    def _add_noise_to_weights(self) -> None:
        """Perturb every shard slightly (seeded by rank): lets tests check that a refit moves weights."""
        gen_ = torch.Generator(device="cpu").manual_seed(1234 + self.rank)
        release_gathered_params(self.model)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=gen_).to(p.device, p.dtype))

    def parameter_checksum(self) -> float:
        """Sum of all parameters (float64, over ranks): lets tests see that weights (did not) change."""
        local = sum((p.detach().double().sum() for p in self.model.parameters()), torch.zeros((), dtype=torch.float64))
        total = local.to(self.device)
        dist.all_reduce(total)
        return float(total)

    def report_notes(self) -> list[str]:
        """Settings that were accepted but have no effect here (e.g. CPU offload on a CPU-only machine)."""
        return list(self.notes)


def _move_module(model: torch.nn.Module, device: torch.device) -> None:
    """Move flat parameter shards and buffers to ``device`` in place of the old storage.

    FSDP1 keeps the sharded storage as ``flat_param._local_shard`` and points
    ``flat_param.data`` back at it after every unshard, so both must move, or
    the next forward would silently use the stale copy.
    """
    with torch.no_grad():
        for p in model.parameters():
            if p.device == device:
                continue
            moved = p.data.to(device, non_blocking=True)
            if getattr(p, "_local_shard", None) is not None and p._local_shard.data_ptr() == p.data.data_ptr():
                p._local_shard = moved
            p.data = moved
        repoint_unsharded_views(model)
        for module in model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.device != device:
                    module._buffers[name] = buffer.to(device, non_blocking=True)
    if device.type == "cpu" and torch.cuda.is_available():
        torch.cuda.synchronize()  # asynchronous copies to the host: complete before anyone reads them
