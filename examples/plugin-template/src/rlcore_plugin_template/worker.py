"""One rank of the 'template' backend: plain data parallel over a Hugging Face model.

rlcore starts one instance per rank inside a Ray actor, with ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set, and calls its methods
from the driver-side ``Policy``. Every rank holds the whole model; the only
parallel step is summing gradients across ranks.

:class:`~rlcore.training.worker_base.TrainingWorkerBase` supplies the method
surface and the shared contracts (logprob alignment and padding, the
optimizer-step loop with globally normalised losses, the reference model as a
CPU copy); a backend says how to build and run its model, how to reduce
gradients, and how to checkpoint. To write a real backend, replace those parts
with your engine's; the conformance kit (``tests/test_conformance.py``) checks
the contracts.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from rlcore.data import BatchedDataDict
from rlcore.training.checkpoint import load_hf_state_dict, load_torch_state, save_hf_checkpoint, save_torch_state
from rlcore.training.logprobs import token_logprobs
from rlcore.training.loop import StepHooks
from rlcore.training.optim import clip_grad_norm_
from rlcore.training.worker_base import TrainingWorkerBase
from rlcore_plugin_template.config import TemplateConfig


class TemplateWorker(TrainingWorkerBase):
    def __init__(
        self,
        config: Any,
        tokenizer: Any = None,
        *,
        weights_path: str | None = None,
        optimizer_path: str | None = None,
        init_optimizer: bool = True,
        init_reference_model: bool = True,
        backend_config: TemplateConfig | None = None,
        layout: Any = None,
    ) -> None:
        # rlcore passes the keyword arguments this signature declares, of those it offers (docs/plugin-api.md);
        # ``layout`` is pure data parallel here (no layout function in our spec: examples/plugin-tp declares one).
        from transformers import AutoModelForCausalLM

        cuda = torch.cuda.is_available()
        if not dist.is_initialized():
            dist.init_process_group("nccl" if cuda else "gloo")  # env:// rendezvous set up by rlcore
        self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
        self.dp_size = dist.get_world_size()
        self.cfg, self.tokenizer = config, tokenizer
        # Our own section, policy.template_cfg, validated with our config class by rlcore (defaults when absent).
        self.own = backend_config if backend_config is not None else TemplateConfig()

        self.model = AutoModelForCausalLM.from_pretrained(
            weights_path or config.model_name, dtype=getattr(torch, config.precision)
        ).to(self.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # The optimizer and scheduler of policy.optimizer / policy.scheduler, their state when resuming, and
        # the reference model (a CPU copy of the initial weights).
        self._init_optimizer_and_reference(
            self.params,
            init_optimizer=init_optimizer,
            optimizer_path=optimizer_path,
            init_reference_model=init_reference_model,
            load_optimizer=self._load_optimizer,
        )

    # -- what the base class asks of a backend ---------------------------------------------
    def _forward_logprobs(self, mb: BatchedDataDict) -> torch.Tensor:
        """``[B, S]`` float32 token logprobs, aligned as rlcore requires (position 0 and padding are 0)."""
        ids, lengths = mb["input_ids"].to(self.device), mb["input_lengths"].to(self.device)
        attention_mask = (torch.arange(ids.shape[1], device=self.device)[None, :] < lengths[:, None]).long()
        logits = self.model(input_ids=ids, attention_mask=attention_mask, use_cache=False).logits
        # Logprobs at the generation temperature, so they compare with the engine's (rlcore's contract).
        return token_logprobs(logits, ids, lengths, temperature=self.logprob_temperature)

    def _step_hooks(self) -> StepHooks:
        return StepHooks(
            forward=self._forward_logprobs,
            all_reduce_sum=dist.all_reduce,  # SUM is the default op
            finish_grads=self._sum_gradients,
            clip_grads=lambda max_norm: clip_grad_norm_(self.params, max_norm),
            optimizer_step=self._optimizer_step,
            zero_grad=lambda: self.model.zero_grad(set_to_none=True),
        )

    def _sum_gradients(self) -> None:
        """Every rank ends with the SUM (not the mean: the loss is already globally normalised) of gradients."""
        for p in self.params:
            if p.grad is None:  # a parameter this rank's data did not reach still takes part
                p.grad = torch.zeros_like(p)
        for bucket in _buckets(self.params, int(self.own.grad_bucket_mb * 2**20)):
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])
            dist.all_reduce(flat)
            for p, summed in zip(bucket, flat.split([p.numel() for p in bucket])):
                p.grad.copy_(summed.view_as(p))

    # -- checkpoints -------------------------------------------------------------------------
    def save_checkpoint(
        self, weights_path: str, optimizer_path: str | None = None, tokenizer_path: str | None = None
    ) -> None:
        """Rank 0 writes HF safetensors (atomically) and the optimizer state; the others wait."""
        if dist.get_rank() == 0:
            save_hf_checkpoint(self._snapshot_to_cpu(), self.model.config, weights_path)
            if optimizer_path and self.optimizer:
                save_torch_state(
                    {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}, optimizer_path
                )
            if tokenizer_path and self.tokenizer is not None:
                self.tokenizer.save_pretrained(tokenizer_path)
        dist.barrier()

    def load_checkpoint(self, weights_path: str, optimizer_path: str | None = None) -> None:
        self.model.load_state_dict(load_hf_state_dict(weights_path), strict=False)
        if optimizer_path and self.optimizer:
            self._load_optimizer(optimizer_path)

    def _load_optimizer(self, optimizer_path: str) -> None:
        state = load_torch_state(optimizer_path)  # weights_only: no arbitrary pickle
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


def _buckets(params: list[torch.nn.Parameter], limit_bytes: int) -> Iterator[list[torch.nn.Parameter]]:
    """Consecutive groups of parameters of about ``limit_bytes`` each: fewer, larger collectives."""
    bucket, size = [], 0
    for p in params:
        bucket.append(p)
        size += p.numel() * p.element_size()
        if size >= limit_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket
