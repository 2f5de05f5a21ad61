"""Abstract contracts of a trainable policy (seed 002, the newer refit surface)."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlcore.data import BatchedDataDict
    from rlcore.interfaces.loss import LossFunction
    from rlcore.interfaces.specs import (
        GenerationDatumSpec,
        LogprobOutputSpec,
        ReferenceLogprobOutputSpec,
        RefitInfo,
        TopkLogitsOutputSpec,
    )


class PolicyInterface(abc.ABC):
    """A policy that computes logprobs and trains on global batches.

    Contracts (design.md §2): logprobs are ``[B, S]`` float32, position 0 is 0,
    position ``i`` holds ``log p(token_i | tokens_<i)`` and padding is 0.
    ``train`` splits ``data`` into ``len(data) // gbs`` optimizer steps; the
    loss is normalised by the valid-token / valid-sequence counts of each whole
    step across data-parallel ranks, so results do not depend on dp size,
    micro-batch size, dynamic batching or sequence packing.
    ``max_grad_norm: None`` disables gradient clipping.
    """

    @abc.abstractmethod
    def get_logprobs(self, data: BatchedDataDict[GenerationDatumSpec]) -> BatchedDataDict[LogprobOutputSpec]:
        """Logprobs of ``data['input_ids']`` under the current policy."""

    @abc.abstractmethod
    def get_reference_policy_logprobs(
        self,
        data: BatchedDataDict[GenerationDatumSpec],
        micro_batch_size: int | None = None,
    ) -> BatchedDataDict[ReferenceLogprobOutputSpec]:
        """Logprobs under the frozen reference model (the initial weights)."""

    @abc.abstractmethod
    def get_topk_logits(
        self,
        data: BatchedDataDict[GenerationDatumSpec],
        k: int,
        micro_batch_size: int | None = None,
    ) -> BatchedDataDict[TopkLogitsOutputSpec]:
        """Top-k logits of next-token positions: ``S - 1`` rows per sequence."""

    @abc.abstractmethod
    def train(
        self,
        data: BatchedDataDict[Any],
        loss_fn: LossFunction,
        eval_mode: bool = False,
        *,
        gbs: int | None = None,
        mbs: int | None = None,
    ) -> dict[str, Any]:
        """Train on ``data``; returns the global loss, grad norm and metrics."""

    def calibrate_qkv_fp8_scales(
        self,
        data: BatchedDataDict[GenerationDatumSpec],
        micro_batch_size: int | None = None,
        percentile: float = 99.9,
        margin: float = 1.05,
        include_q: bool = False,
    ) -> dict[str, Any]:
        """FP8 KV-cache calibration; no rlcore backend supports FP8 yet."""
        raise NotImplementedError(f"{type(self).__name__} does not support FP8 KV-cache calibration")

    @abc.abstractmethod
    def prepare_for_training(self, *args: Any, **kwargs: Any) -> None: ...

    @abc.abstractmethod
    def finish_training(self, *args: Any, **kwargs: Any) -> None: ...

    @abc.abstractmethod
    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None: ...

    @abc.abstractmethod
    def shutdown(self) -> bool: ...


class ColocatablePolicyInterface(PolicyInterface):
    """A policy that can share devices with a generation engine and refit it.

    Refit contract (design.md §2.7): ``prepare_refit_info`` returns
    ``{hf_name: (shape, dtype)}`` once; the weights are then sent as full,
    Hugging Face-named tensors in that same deterministic order, either
    streamed through shared memory (CUDA IPC on GPU) to a colocated engine, or
    broadcast as packed buckets over a collective group spanning training and
    generation ranks.
    """

    @abc.abstractmethod
    def init_collective(self, ip: str, port: int, world_size: int, *, train_world_size: int) -> list[Any]:
        """Join the refit process group; returns futures to wait on."""

    @abc.abstractmethod
    def offload_before_refit(self) -> None: ...

    @abc.abstractmethod
    def offload_after_refit(self) -> None: ...

    @abc.abstractmethod
    def prepare_refit_info(self) -> RefitInfo | None:
        """``{hf_name: (shape, dtype)}`` of every tensor a refit sends."""

    @abc.abstractmethod
    def stream_weights_via_ipc_zmq(self, *args: Any, **kwargs: Any) -> list[Any]:
        """Stream packed weight buffers to a colocated engine; returns futures."""

    @abc.abstractmethod
    def broadcast_weights_for_collective(self, kv_scales: dict[str, float] | None = None) -> list[Any]:
        """Broadcast packed buckets from training rank 0; returns futures."""

    @abc.abstractmethod
    def prepare_for_lp_inference(self) -> None: ...
