"""The reference backend: the smallest correct training backend.

Plain torch, one process per rank, data parallel only: every rank holds the
full Hugging Face model, gradients are summed over ranks with one all-reduce
(gloo on CPU, NCCL on GPU). It exists so the runtime can be tested against a
backend with no sharding tricks, and to show backend authors what a worker
must do; the shared step semantics come from :mod:`rlcore.training.loop`.
"""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist

from rlcore.data import BatchedDataDict
from rlcore.training.checkpoint import load_hf_state_dict, load_torch_state, save_hf_checkpoint, save_torch_state
from rlcore.training.logprobs import token_logprobs, topk_logits
from rlcore.training.loop import StepHooks, micro_batches, train_steps
from rlcore.training.optim import build_optimizer, build_scheduler, clip_grad_norm_

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def init_process_group_from_env() -> None:
    """Join the rank's default process group (env:// rendezvous set by the worker group)."""
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=timedelta(minutes=10))


class ReferenceWorker:
    """One rank of the reference backend (seed 003/004 surface, data parallel only)."""

    def __init__(self, config: Any, tokenizer: Any = None, weights_path: str | None = None,
                 optimizer_path: str | None = None, init_optimizer: bool = True,
                 init_reference_model: bool = True, **_: Any) -> None:
        from transformers import AutoModelForCausalLM

        init_process_group_from_env()
        self.cfg = config
        self.tokenizer = tokenizer
        self.rank = dist.get_rank()
        self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() \
            else torch.device("cpu")
        self.model = AutoModelForCausalLM.from_pretrained(
            weights_path or config.model_name, dtype=_DTYPES[config.precision]
        ).to(self.device)
        self.optimizer = build_optimizer(self.model.parameters(), config.optimizer, config.learning_rate) \
            if init_optimizer else None
        self.scheduler = build_scheduler(self.optimizer, config.scheduler) if self.optimizer else None
        if optimizer_path and self.optimizer is not None:
            self._load_optimizer(optimizer_path)
        self.reference_state = (
            {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
            if init_reference_model else None
        )

    # -- model passes ----------------------------------------------------------
    def _logits(self, mb: BatchedDataDict) -> torch.Tensor:
        ids = mb["input_ids"].to(self.device)
        positions = torch.arange(ids.shape[1], device=self.device)
        attention_mask = (positions[None, :] < mb["input_lengths"].to(self.device)[:, None]).long()
        return self.model(input_ids=ids, attention_mask=attention_mask, use_cache=False).logits

    def _forward_logprobs(self, mb: BatchedDataDict) -> torch.Tensor:
        return token_logprobs(self._logits(mb), mb["input_ids"].to(self.device), mb["input_lengths"])

    def _map_micro_batches(self, data: BatchedDataDict, fn, micro_batch_size: int | None, mode: str) -> list:
        mbs = micro_batch_size or self.cfg.logprob_batch_size
        with torch.no_grad():
            return [fn(mb) for mb in micro_batches(data, mbs, mode)]

    def get_logprobs(self, data: BatchedDataDict, micro_batch_size: int | None = None,
                     mode: str = "plain") -> BatchedDataDict:
        self.model.eval()
        parts = self._map_micro_batches(data, lambda mb: {"logprobs": self._forward_logprobs(mb).cpu()},
                                        micro_batch_size, mode)
        out = BatchedDataDict.from_batches(parts)
        return _pad_to(out, "logprobs", data["input_ids"].shape[1])

    @contextlib.contextmanager
    def use_reference_model(self) -> Iterator[None]:
        """Swap the reference weights in (from their CPU copy) and the trained ones back out."""
        if self.reference_state is None:
            raise RuntimeError("this worker was created with init_reference_model=False")
        trained = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
        self.model.load_state_dict(self.reference_state)
        try:
            yield
        finally:
            self.model.load_state_dict(trained)

    def get_reference_policy_logprobs(self, data: BatchedDataDict, micro_batch_size: int | None = None,
                                      mode: str = "plain") -> BatchedDataDict:
        with self.use_reference_model():
            out = self.get_logprobs(data, micro_batch_size, mode)
        return BatchedDataDict(reference_logprobs=out["logprobs"])

    def get_topk_logits(self, data: BatchedDataDict, k: int, micro_batch_size: int | None = None,
                        mode: str = "plain") -> BatchedDataDict:
        self.model.eval()

        def run(mb):
            values, indices = topk_logits(self._logits(mb), k)
            return {"topk_logits": values.cpu(), "topk_indices": indices.cpu()}

        out = BatchedDataDict.from_batches(self._map_micro_batches(data, run, micro_batch_size, mode))
        width = data["input_ids"].shape[1] - 1
        return _pad_to(_pad_to(out, "topk_logits", width), "topk_indices", width)

    # -- training --------------------------------------------------------------
    def train(self, data: BatchedDataDict, loss_fn: Any, eval_mode: bool = False, gbs: int | None = None,
              mbs: int | None = None, mode: str = "plain") -> dict[str, Any]:
        if self.optimizer is None and not eval_mode:
            raise RuntimeError("this worker was created with init_optimizer=False; it cannot train")
        gbs = gbs or self.cfg.train_global_batch_size
        mbs = mbs or self.cfg.train_micro_batch_size
        self.model.train(not eval_mode)
        params = [p for p in self.model.parameters() if p.requires_grad]

        def all_reduce_sum(t: torch.Tensor) -> None:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)

        def finish_grads() -> None:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)  # one collective for all gradients
            offset = 0
            for p, g in zip(params, grads):
                p.grad = flat[offset:offset + g.numel()].view_as(g)
                offset += g.numel()

        def optimizer_step() -> None:
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)

        hooks = StepHooks(
            forward=self._forward_logprobs,
            all_reduce_sum=all_reduce_sum,
            finish_grads=finish_grads,
            clip_grads=lambda max_norm: clip_grad_norm_(params, max_norm),
            optimizer_step=optimizer_step,
            zero_grad=lambda: self.model.zero_grad(set_to_none=True),
        )
        return train_steps(data, loss_fn, hooks, local_batch_size=gbs // dist.get_world_size(), mbs=mbs,
                           max_grad_norm=self.cfg.max_grad_norm, eval_mode=eval_mode, mode=mode)

    # -- lifecycle -------------------------------------------------------------
    def prepare_for_training(self, *args: Any, **kwargs: Any) -> None:
        self.model.train()

    def prepare_for_lp_inference(self) -> None:
        self.model.eval()

    def finish_training(self, *args: Any, **kwargs: Any) -> None:
        pass

    def offload_before_refit(self) -> None:
        pass

    def offload_after_refit(self) -> None:
        pass

    # -- checkpoints -------------------------------------------------------------
    def save_checkpoint(self, weights_path: str, optimizer_path: str | None = None,
                        tokenizer_path: str | None = None) -> None:
        """Rank 0 writes HF safetensors (+ optimizer state); all ranks then synchronise."""
        if self.rank == 0:
            state = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
            save_hf_checkpoint(state, self.model.config, weights_path)
            if tokenizer_path and self.tokenizer is not None:
                self.tokenizer.save_pretrained(tokenizer_path)
            if optimizer_path and self.optimizer is not None:
                save_torch_state({"optimizer": self.optimizer.state_dict(),
                                  "scheduler": self.scheduler.state_dict()}, optimizer_path)
        dist.barrier()

    def load_checkpoint(self, weights_path: str, optimizer_path: str | None = None) -> None:
        self.model.load_state_dict(load_hf_state_dict(weights_path), strict=False)
        if optimizer_path and self.optimizer is not None:
            self._load_optimizer(optimizer_path)

    def _load_optimizer(self, optimizer_path: str) -> None:
        state = load_torch_state(optimizer_path)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    # -- introspection -----------------------------------------------------------
    def is_alive(self) -> bool:
        return True

    def report_device_id(self) -> str:
        return str(self.device)

    def get_gpu_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"rank": self.rank, "device": str(self.device), "pid": os.getpid()}
        if self.device.type == "cuda":
            info["memory_allocated_mb"] = torch.cuda.memory_allocated(self.device) / 2**20
        return info

    def reset_peak_memory_stats(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def parameter_checksum(self) -> float:
        """Sum of all parameters in float64: lets tests see that weights (did not) change."""
        return float(sum(p.detach().double().sum() for p in self.model.parameters()))

    def state_dict_cpu(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    def start_gpu_profiling(self) -> None:
        pass

    def stop_gpu_profiling(self) -> None:
        pass

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _pad_to(data: BatchedDataDict, key: str, width: int) -> BatchedDataDict:
    """Right-pad ``data[key]`` along dim 1 with zeros to ``width`` (micro-batches may be narrower)."""
    t = data[key]
    if t.shape[1] < width:
        pad = torch.zeros(t.shape[0], width - t.shape[1], *t.shape[2:], dtype=t.dtype)
        data[key] = torch.cat([t, pad], dim=1)
    return data
