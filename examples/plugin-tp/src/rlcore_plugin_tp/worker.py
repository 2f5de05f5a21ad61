"""One rank of the 'tpexample' backend: tensor parallel inside each data-parallel replica.

rlcore builds it with the layout this backend declared
(:mod:`rlcore_plugin_tp.layout`, passed as ``layout=``), ranks laid out (pp, dp, cp, tp) with tp
fastest, and gives the tp ranks of one data-parallel index the same data. The
shared contracts (alignment, the optimizer-step loop with globally normalised
losses, the reference model as a CPU copy of this rank's slices) come from
:class:`~rlcore.training.worker_base.TrainingWorkerBase`; this class says how
to build the split model, how to reduce gradients and norms over the two
groups, and how to checkpoint full tensors.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from rlcore.data import BatchedDataDict
from rlcore.training.checkpoint import load_hf_state_dict, load_torch_state, save_torch_state
from rlcore.training.logprobs import token_logprobs
from rlcore.training.loop import StepHooks
from rlcore.training.sharded_checkpoint import on_rank0, save_gathered
from rlcore.training.worker_base import TrainingWorkerBase
from rlcore_plugin_tp.tensor_parallel import Slice, key_value_holders, process_groups, shard_decoder


class TPWorker(TrainingWorkerBase):
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
        from transformers import AutoModelForCausalLM

        cuda = torch.cuda.is_available()
        if not dist.is_initialized():
            dist.init_process_group("nccl" if cuda else "gloo")  # env:// rendezvous set up by rlcore
        self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
        self.cfg, self.tokenizer = config, tokenizer
        self.tp_size = layout.tp  # what our layout function declared, handed back by rlcore
        self.dp_size = dist.get_world_size() // self.tp_size
        self.tp_rank = dist.get_rank() % self.tp_size

        model = AutoModelForCausalLM.from_pretrained(
            weights_path or config.model_name, dtype=getattr(torch, config.precision)
        )
        self.hf_config = model.config
        holders = key_value_holders(model.config, self.tp_size)
        self.tp_group, self.dp_group, self.share_group = process_groups(self.tp_size, holders)
        self.parts: dict[str, Slice] = shard_decoder(model, self.tp_group, self.tp_rank, self.tp_size)
        self.model = model.to(self.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        names = {id(p): name for name, p in self.model.named_parameters()}
        self.param_parts = [self.parts.get(names[id(p)]) for p in self.params]  # in the optimizer's order
        self._init_optimizer_and_reference(
            self.params,
            init_optimizer=init_optimizer,
            optimizer_path=optimizer_path,
            init_reference_model=init_reference_model,
            load_optimizer=self._load_optimizer,
        )

    # -- what the base class asks of a backend ---------------------------------------------
    def _forward_logprobs(self, mb: BatchedDataDict) -> torch.Tensor:
        self._check_same_data_as_tp_peers(mb)
        ids, lengths = mb["input_ids"].to(self.device), mb["input_lengths"].to(self.device)
        attention_mask = (torch.arange(ids.shape[1], device=self.device)[None, :] < lengths[:, None]).long()
        logits = self.model(input_ids=ids, attention_mask=attention_mask, use_cache=False).logits
        return token_logprobs(logits, ids, lengths, temperature=self.logprob_temperature)

    def _step_hooks(self) -> StepHooks:
        return StepHooks(
            forward=self._forward_logprobs,
            # tp peers hold the same data: counts and losses are summed over the data-parallel group only
            all_reduce_sum=lambda t: self._all_reduce_sum(t, self.dp_group),
            finish_grads=self._sum_gradients_over_dp,
            clip_grads=self._clip_grads,
            optimizer_step=self._optimizer_step,
            zero_grad=lambda: self.model.zero_grad(set_to_none=True),
        )

    def _check_same_data_as_tp_peers(self, mb: BatchedDataDict) -> None:
        """The tp ranks of a replica must run the same sequences; if rlcore sharded data by any other layout
        than the one we declared, this fails at the first forward instead of training on mixed rows."""
        if self.tp_size == 1:
            return
        mine = torch.tensor([float(mb["input_ids"].sum()), float(mb["input_lengths"].sum())], dtype=torch.float64)
        low, high = mine.clone(), mine.clone()
        self._all_reduce_op(low, dist.ReduceOp.MIN)
        self._all_reduce_op(high, dist.ReduceOp.MAX)
        if not torch.equal(low, high):
            raise RuntimeError(
                "the tensor-parallel ranks of one replica received different data: the layout "
                "rlcore sharded by is not this backend's"
            )

    def _all_reduce_op(self, t: torch.Tensor, op: Any) -> None:
        on_device = t.to(self.device)
        dist.all_reduce(on_device, op=op, group=self.tp_group)
        t.copy_(on_device)

    def _sum_gradients_over_dp(self) -> None:
        """Every rank ends with the dp-SUM of its gradients (its slice's, or the replicated ones); a shared
        key/value head's gradient is first summed over the tp ranks that read it."""
        for p, part in zip(self.params, self.param_parts):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if part is not None and part.holders > 1:
                dist.all_reduce(p.grad, group=self.share_group)
        flat = torch.cat([p.grad.reshape(-1) for p in self.params])
        dist.all_reduce(flat, group=self.dp_group)
        for p, summed in zip(self.params, flat.split([p.numel() for p in self.params])):
            p.grad.copy_(summed.view_as(p))

    def _clip_grads(self, max_norm: float | None) -> float:
        """The global norm, summed over the tp group with each tensor counted once: a squared norm is divided
        by how many tp ranks hold that tensor (1 for a slice, all of them for a replicated tensor)."""
        squares = torch.zeros((), dtype=torch.float64, device=self.device)
        for p, part in zip(self.params, self.param_parts):
            copies = part.holders if part is not None else self.tp_size
            squares += p.grad.detach().double().square().sum() / copies
        dist.all_reduce(squares, group=self.tp_group)
        norm = math.sqrt(float(squares))
        if max_norm is not None and max_norm / (norm + 1e-6) < 1.0:
            for p in self.params:
                p.grad.detach().mul_(max_norm / (norm + 1e-6))
        return norm

    # -- checkpoints: full Hugging Face tensors, gathered from the tp slices -----------------------
    def _full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, full tensor)`` of the whole model, in state-dict order. Collective over tp."""
        for name, tensor in self.model.state_dict().items():
            part = self.parts.get(name)
            yield name, (part.gather(tensor, self.tp_group, self.tp_size) if part is not None else tensor).cpu()

    def save_checkpoint(
        self, weights_path: str, optimizer_path: str | None = None, tokenizer_path: str | None = None
    ) -> None:
        """Rank 0 writes HF safetensors and the full optimizer state, gathered as they come; all ranks take
        part in the gathers."""
        save_gathered(self._full_tensors(), self.hf_config, weights_path)
        if optimizer_path and self.optimizer is not None:
            state = {"optimizer": self._full_optimizer_state(), "scheduler": self.scheduler.state_dict()}
            on_rank0(lambda: save_torch_state(state, optimizer_path))
        if tokenizer_path and self.tokenizer is not None:
            on_rank0(lambda: self.tokenizer.save_pretrained(tokenizer_path))

    def load_checkpoint(self, weights_path: str, optimizer_path: str | None = None) -> None:
        full = load_hf_state_dict(weights_path)
        local = {name: self._mine(name, t) for name, t in full.items()}
        self.model.load_state_dict(local, strict=False)
        if optimizer_path and self.optimizer is not None:
            self._load_optimizer(optimizer_path)

    def _mine(self, name: str, full: torch.Tensor) -> torch.Tensor:
        part = self.parts.get(name)
        return part.of(full) if part is not None else full

    def _per_parameter(self, state: dict, fn: Any) -> dict:
        """A copy of an optimizer state dict with ``fn(tensor, part)`` applied to each split parameter's tensors."""

        def convert(index: int, value: Any) -> Any:
            part = self.param_parts[index]
            if part is None or not torch.is_tensor(value) or value.dim() == 0:
                return value  # a replicated parameter's state, or a step count
            return fn(value, part)

        per_param = {i: {k: convert(i, v) for k, v in entry.items()} for i, entry in state["state"].items()}
        return {**state, "state": per_param}

    def _full_optimizer_state(self) -> dict:
        """The optimizer state with every per-parameter tensor gathered to its full shape. Collective over tp."""
        return self._per_parameter(
            self.optimizer.state_dict(), lambda t, part: part.gather(t, self.tp_group, self.tp_size).cpu()
        )

    def _load_optimizer(self, optimizer_path: str) -> None:
        saved = load_torch_state(optimizer_path)  # weights_only: no arbitrary pickle
        self.optimizer.load_state_dict(self._per_parameter(saved["optimizer"], lambda t, part: part.of(t)))
        self.scheduler.load_state_dict(saved["scheduler"])
