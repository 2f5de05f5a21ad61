"""Megatron's pipeline schedule as the worker runs it: micro-batches through every stage in lockstep, and
results moved from the last pipeline stage to every stage (``Policy`` reads from pipeline rank 0).

:class:`PipelineStages` is a mixin of ``MegatronPolicyWorker``: it reads the worker's ``model``, ``cfg``, ``mcfg``,
``device``, ``pp_size``, ``pp_ranks``, ``pp_group`` and ``router_logits`` (a mixture of experts' router recorder).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from rlcore.data import BatchedDataDict


def _attention_mask(lengths: torch.Tensor, width: int, device: torch.device) -> torch.Tensor:
    """``[B, 1, S, S]`` bool, True where attention is *not* allowed: causal, and no key past a sequence's end."""
    positions = torch.arange(width, device=device)
    causal = positions[None, :] > positions[:, None]
    past_end = positions[None, :] >= lengths.to(device)[:, None]
    return (causal[None] | past_end[:, None, :])[:, None]


def width_multiple(divisible_by: int, tp: int, sequence_parallel: bool, cp: int = 1) -> int:
    """What every micro-batch's width is padded to a multiple of: ``policy.make_sequence_length_divisible_by``;
    ``2·cp`` under context parallelism (``2·cp`` chunks, :mod:`rl_megatron.context_parallel`), times ``tp`` under
    sequence parallelism (megatron splits each rank's positions evenly over the TP ranks). As NeMo-RL does, the
    padding is the backend's own: it lies past every ``input_lengths``, and the worker cuts the logits back to the
    caller's width, so nothing computed for the real tokens changes."""
    split = (2 * cp if cp > 1 else 1) * (tp if sequence_parallel else 1)
    return math.lcm(divisible_by, split)


def logits_for_loss(logits: torch.Tensor, defer_fp32_logits: bool) -> torch.Tensor:
    """The output layer's logits as the logprob and loss computations receive them: cast to float32 at once, or,
    with ``policy.megatron_cfg.defer_fp32_logits``, left in the training dtype (no float32 copy of the whole
    ``[B, S, V/tp]`` tensor): those computations upcast before any arithmetic, so the numbers are the same."""
    return logits if defer_fp32_logits else logits.float()


class PipelineStages:
    """Runs micro-batches through megatron's pipeline schedule and broadcasts the last stage's results."""

    def _from_last_stage(self, obj: Any) -> Any:
        """``obj`` as computed on the last pipeline stage, on every stage (a picklable object)."""
        if self.pp_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.pp_ranks[-1], group=self.pp_group)
        return box[0]

    def _tensor_from_last_stage(
        self, tensor: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        if self.pp_size == 1:
            return tensor
        if tensor is None:
            tensor = torch.empty(shape, dtype=dtype, device=self.device)
        tensor = tensor.to(self.device).contiguous()
        dist.broadcast(tensor, src=self.pp_ranks[-1], group=self.pp_group)
        return tensor

    def _run_schedule(
        self, micro_batches: list[BatchedDataDict], on_logits: Callable[[BatchedDataDict, Any], Any], forward_only: bool
    ) -> None:
        """Run ``micro_batches`` through every stage; the last stage calls ``on_logits(mb, logits)``.

        ``on_logits`` returns this micro-batch's loss (a scalar to back-propagate) or None in
        inference passes.
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        device = self.device
        m = self.mcfg
        multiple = width_multiple(
            self.cfg.make_sequence_length_divisible_by,
            m.tensor_model_parallel_size,
            m.sequence_parallel,
            m.context_parallel_size,
        )
        cp_group = getattr(self, "cp_group", None)  # context parallelism: this rank's positions, then all of them
        router_logits = getattr(self, "router_logits", None)
        defer_fp32_logits = self.mcfg.defer_fp32_logits

        def fit(n: int) -> int:  # each micro-batch's own longest sequence, rounded up to the multiple
            return -(-max(n, 2) // multiple) * multiple

        def forward_step(data_iterator: Iterator[BatchedDataDict], model: torch.nn.Module) -> tuple:
            mb = next(data_iterator)
            lengths = mb["input_lengths"]
            width = fit(int(lengths.max()))
            ids = mb["input_ids"][:, :width].to(device)
            if ids.shape[1] < width:
                ids = torch.nn.functional.pad(ids, (0, width - ids.shape[1]))
            mask = _attention_mask(lengths, width, device)
            positions = torch.arange(width, device=device)
            if cp_group is not None:
                from rl_megatron.context_parallel import local_positions

                size, rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
                positions = local_positions(width, size, rank, device)
                ids, mask = ids[:, positions], mask[:, :, positions]  # queries here, keys everywhere
            if router_logits is not None:
                router_logits.clear()  # a new forward: the routers' logits of this micro-batch only
            output = model(ids, positions[None, :].expand_as(ids), mask)

            def loss_func(logits: torch.Tensor) -> tuple:
                if cp_group is not None:
                    from rl_megatron.context_parallel import gather_logits

                    logits = gather_logits(logits, cp_group)
                loss = on_logits(mb, logits_for_loss(logits, defer_fp32_logits))
                if loss is None:
                    loss = logits.new_zeros(())
                return loss, torch.ones((), dtype=torch.int), {}

            return output, loss_func

        width = max(fit(int(mb["input_lengths"].max())) for mb in micro_batches)
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro_batches),
            model=[self.model],
            num_microbatches=len(micro_batches),
            seq_length=width,
            micro_batch_size=micro_batches[0].size,
            forward_only=forward_only,
        )


__all__ = ["PipelineStages", "logits_for_loss", "width_multiple"]
