"""The reference backend: the smallest correct training backend.

Plain torch, one process per rank, data parallel only: every rank holds the
full Hugging Face model, and gradients are summed over ranks with one
all-reduce (gloo on CPU, NCCL on GPU). It exists so the runtime can be tested
against a backend with no sharding tricks, and to show backend authors what a
worker must provide on top of :class:`rlcore.training.worker_base.TrainingWorkerBase`
(plugin API 2: ``rlcore.interfaces.workers``, ``docs/plugin-api.md``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from rlcore.refit import RefitExportMixin, metadata_of
from rlcore.training.checkpoint import load_hf_state_dict, load_torch_state, save_hf_checkpoint, save_torch_state
from rlcore.training.loop import StepHooks
from rlcore.training.optim import clip_grad_norm_
from rlcore.training.process_group import init_distributed
from rlcore.training.worker_base import DTYPES, TrainingWorkerBase


class ReferenceWorker(RefitExportMixin, TrainingWorkerBase):
    """One rank of the reference backend."""

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
        # No config class and no layout function: backend_config is None and the layout pure data parallel.
        from rlcore.training.hf_config import pretrained_model

        self.device = init_distributed()
        self.cfg = config
        self.tokenizer = tokenizer
        self.rank = dist.get_rank()
        self.dp_size = dist.get_world_size()
        self.model = pretrained_model(
            weights_path or config.model_name, config.hf_config_overrides, dtype=DTYPES[config.precision]
        ).to(self.device)
        self._init_optimizer_and_reference(
            self.model.parameters(),
            init_optimizer=init_optimizer,
            optimizer_path=optimizer_path,
            init_reference_model=init_reference_model,
            load_optimizer=self._load_optimizer,
        )

    # -- the step (the forwards are TrainingWorkerBase's: a whole HF model on every rank) ---
    def _step_hooks(self) -> StepHooks:
        params = [p for p in self.model.parameters() if p.requires_grad]

        def finish_grads() -> None:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)  # one collective for all gradients
            offset = 0
            for p, g in zip(params, grads):
                p.grad = flat[offset : offset + g.numel()].view_as(g)
                offset += g.numel()

        return StepHooks(
            forward=self._forward_logprobs,
            forward_with_inputs=self._forward_with_inputs,
            all_reduce_sum=self._all_reduce_sum,
            finish_grads=finish_grads,
            clip_grads=lambda max_norm: clip_grad_norm_(params, max_norm),
            optimizer_step=self._optimizer_step,
            zero_grad=lambda: self.model.zero_grad(set_to_none=True),
        )

    # -- refit export: every rank holds the full model, already under HF names -------------
    def prepare_refit_info(self) -> dict:
        return metadata_of(self.model.state_dict().items())

    def iter_refit_tensors(self):
        yield from self.model.state_dict().items()

    # -- checkpoints -------------------------------------------------------------------
    def save_checkpoint(
        self, weights_path: str, optimizer_path: str | None = None, tokenizer_path: str | None = None
    ) -> None:
        """Rank 0 writes HF safetensors (+ optimizer state); all ranks then synchronise."""
        if self.rank == 0:
            state = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
            save_hf_checkpoint(state, self.model.config, weights_path)
            if tokenizer_path and self.tokenizer is not None:
                self.tokenizer.save_pretrained(tokenizer_path)
            if optimizer_path and self.optimizer is not None:
                save_torch_state(
                    {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}, optimizer_path
                )
        dist.barrier()

    def load_checkpoint(self, weights_path: str, optimizer_path: str | None = None) -> None:
        self.model.load_state_dict(load_hf_state_dict(weights_path), strict=False)
        if optimizer_path and self.optimizer is not None:
            self._load_optimizer(optimizer_path)

    def _load_optimizer(self, optimizer_path: str) -> None:
        state = load_torch_state(optimizer_path)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    # -- test helpers --------------------------------------------------------------------
    def parameter_checksum(self) -> float:
        """Sum of all parameters in float64: lets tests see that weights (did not) change."""
        return float(sum(p.detach().double().sum() for p in self.model.parameters()))

    def state_dict_cpu(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
