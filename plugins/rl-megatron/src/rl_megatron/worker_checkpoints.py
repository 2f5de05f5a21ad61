"""The megatron worker's checkpoints: Hugging Face weights, and a megatron distributed checkpoint of the model,
optimizer and scheduler (reshardable over tp and pp), published atomically (:mod:`rl_megatron.checkpointing`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from rl_megatron import checkpointing
from rlcore.training.checkpoint_files import check_inside


class MegatronCheckpoints:
    """Checkpoint methods of :class:`rl_megatron.worker.MegatronPolicyWorker` (a mixin: it uses the worker's
    model, optimizer, scheduler and layout)."""

    gpt: Any
    optimizer: Any
    scheduler: Any
    mcfg: Any
    device: Any
    hf_config: Any
    tokenizer: Any
    shape: Any
    experts: Any
    tp_size: int
    pp_size: int
    exporter: Iterable[tuple[str, Any]]  # the whole model as full HF tensors (collective)
    _load_hf: Callable[[str], None]

    @property
    def _distributed_optimizer(self) -> bool:
        return self.optimizer is not None and self.mcfg.optimizer.use_distributed_optimizer

    # -- checkpoints --------------------------------------------------------------------------------
    def _sharded_state(self, is_loading: bool, with_optimizer: bool) -> dict[str, Any]:
        model_state = self.gpt.sharded_state_dict()
        state: dict[str, Any] = {"model": model_state}
        if with_optimizer:
            metadata = None
            if self._distributed_optimizer:
                from rl_megatron import optimizer

                metadata = optimizer.distributed_checkpoint_metadata(self.device.type == "cuda")
                if is_loading:
                    optimizer.create_missing_adam_state(self.optimizer)
            state["optimizer"] = self.optimizer.sharded_state_dict(
                model_state, is_loading=is_loading, metadata=metadata
            )
            state["scheduler"] = self.scheduler.state_dict()
        return state

    def save_checkpoint(
        self, weights_path: str, optimizer_path: str | None = None, tokenizer_path: str | None = None
    ) -> None:
        """HF safetensors at ``weights_path``; a megatron distributed checkpoint (model, optimizer,
        scheduler; reshardable) at ``optimizer_path``. Both are published atomically. Collective."""
        from rlcore.training.checkpoint import save_tokenizer
        from rlcore.training.sharded_checkpoint import on_rank0, save_gathered

        save_gathered(iter(self.exporter), self.hf_config, weights_path)
        if tokenizer_path and self.tokenizer is not None:
            on_rank0(lambda: save_tokenizer(self.tokenizer, tokenizer_path))
        if optimizer_path:
            info = {
                "format": "megatron-dist-checkpoint",
                "tensor_model_parallel_size": self.tp_size,
                "pipeline_model_parallel_size": self.pp_size,
                "expert_model_parallel_size": self.experts.size,
                "optimizer": self.optimizer is not None,
                "distributed_optimizer": self._distributed_optimizer,
                "architecture": self.shape.architecture,
            }
            checkpointing.save(self._sharded_state(False, self.optimizer is not None), optimizer_path, info)

    def load_checkpoint(self, weights_path: str, optimizer_path: str | None = None) -> None:
        for checkpoint in filter(None, (weights_path, optimizer_path)):
            check_inside(checkpoint)  # a checkpoint reads its own files only
        self._load_hf(weights_path)
        if optimizer_path:
            self._load_megatron_checkpoint(optimizer_path)

    def _load_megatron_checkpoint(self, path: str) -> None:
        """Model (and, when both sides have one, optimizer + scheduler) from a distributed checkpoint,
        resharded to this run's TP/PP layout."""
        info = checkpointing.read_info(path)
        with_optimizer = self.optimizer is not None and info.get("optimizer", False)
        saved_ep = info.get("expert_model_parallel_size", 1)
        if with_optimizer and saved_ep != self.experts.size:
            # megatron keeps expert parameters in an optimizer of their own only with EP > 1: the state differs.
            raise ValueError(
                f"{path}: its optimizer state was saved at policy.megatron_cfg.expert_model_parallel_size="
                f"{saved_ep}, this run has {self.experts.size}; resume at the same expert-parallel size, or load "
                "the weights alone (without the optimizer)"
            )
        saved_distributed = info.get("distributed_optimizer", False)
        if with_optimizer and saved_distributed != self._distributed_optimizer:
            raise ValueError(
                f"{path}: its optimizer state was saved with policy.megatron_cfg.optimizer.use_distributed_optimizer="
                f"{str(saved_distributed).lower()}, this run has {str(self._distributed_optimizer).lower()} (the two "
                "store it differently); resume with the same setting, or load the weights alone (without the optimizer)"
            )
        loaded = checkpointing.load(self._sharded_state(True, with_optimizer), path)
        missing, _ = self.gpt.load_state_dict(loaded["model"], strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing:
            raise RuntimeError(f"{path}: the checkpoint lacks model tensors {missing[:5]}")
        if with_optimizer:
            if self._distributed_optimizer:
                from rl_megatron import optimizer

                optimizer.load_distributed_state(self.optimizer, loaded["optimizer"])
            else:
                self.optimizer.load_state_dict(loaded["optimizer"])
            self.scheduler.load_state_dict(loaded["scheduler"])


__all__ = ["MegatronCheckpoints"]
