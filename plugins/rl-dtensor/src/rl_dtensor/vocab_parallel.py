"""Token logprobs and top-k from vocab-parallel logits, without gathering the vocabulary.

Under tensor parallel the LM head leaves each tp rank with a contiguous slice
of the vocabulary (a ``Shard(-1)`` DTensor). ``log p(t) = x_t - logsumexp(x)``
needs only three tp reductions of ``[B, T]`` tensors — the max, the sum of
exponentials and the target logit (which lives on one rank) — instead of an
all-gather of ``[B, T, V]``.

The backward is local: every tp rank computes the same (replicated) loss, so
each rank's gradient of its logit slice is ``g * (onehot - softmax)`` on that
slice; the DTensor machinery of the LM head then sums the partial input
gradients over tp.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard


def shard_offset(vocab_size: int, tp_size: int, tp_rank: int) -> int:
    """First vocabulary index of a rank's slice (``torch.chunk`` semantics, as DTensor ``Shard`` uses)."""
    chunk = -(-vocab_size // tp_size)
    return min(tp_rank * chunk, vocab_size)


def _vocab_sharded(logits: DTensor) -> bool:
    """True for a DTensor on a 1-D mesh split along its last dimension (what the TP plans produce)."""
    placement = logits.placements[0]
    return logits.device_mesh.ndim == 1 and isinstance(placement, Shard) \
        and placement.dim % logits.ndim == logits.ndim - 1


def _local_vocab(logits: DTensor) -> tuple[torch.Tensor, dist.ProcessGroup, int]:
    """This rank's logit slice, the tp group and the slice's first vocabulary index."""
    mesh = logits.device_mesh
    group = mesh.get_group()
    offset = shard_offset(logits.shape[-1], mesh.size(), mesh.get_local_rank())
    return logits.to_local(), group, offset


class _VocabParallelLogprob(torch.autograd.Function):
    """``log_softmax(x)[target]`` where ``x``'s last dimension is split across ``group``."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, target: torch.Tensor, offset: int, group) -> torch.Tensor:
        ctx.input_dtype = local.dtype
        local = local.float()
        vocab_local = local.shape[-1]
        row_max = local.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = local - row_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=group)

        index = target - offset
        here = (index >= 0) & (index < vocab_local)
        picked = shifted.gather(-1, index.clamp(0, vocab_local - 1).unsqueeze(-1)).squeeze(-1)
        picked = torch.where(here, picked, torch.zeros_like(picked))
        dist.all_reduce(picked, op=dist.ReduceOp.SUM, group=group)

        exp.div_(sum_exp.unsqueeze(-1))  # now the softmax of this slice, kept for backward
        ctx.save_for_backward(exp, index, here)
        return picked - sum_exp.log()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, index, here = ctx.saved_tensors
        grad_local = -softmax * grad.unsqueeze(-1)
        onehot = torch.zeros_like(grad_local)
        onehot.scatter_(-1, index.clamp(0, softmax.shape[-1] - 1).unsqueeze(-1),
                        (grad * here).unsqueeze(-1))
        return (grad_local + onehot).to(ctx.input_dtype), None, None, None


def _replicated(logits: DTensor) -> torch.Tensor:
    return logits.redistribute(placements=[Replicate()] * logits.device_mesh.ndim).to_local()


def gather_logprobs(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)[..., target]`` in float32, for plain or vocab-sharded DTensor logits.

    ``logits`` is ``[..., V]`` and ``target`` ``[...]`` (same leading shape).
    """
    if isinstance(logits, DTensor) and not _vocab_sharded(logits):
        logits = _replicated(logits)  # e.g. a custom plan that gathers the output
    if isinstance(logits, DTensor):
        local, group, offset = _local_vocab(logits)
        return _VocabParallelLogprob.apply(local, target.to(local.device), offset, group)
    logits = logits.float()
    picked = logits.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k float32 values and global vocabulary indices over the last dimension.

    For vocab-sharded logits each rank takes its local top-k; the global top-k
    is among those ``tp * k`` candidates, gathered (small) and reduced.
    """
    if isinstance(logits, DTensor) and not _vocab_sharded(logits):
        logits = _replicated(logits)
    if not isinstance(logits, DTensor):
        values, indices = logits.float().topk(k, dim=-1)
        return values, indices
    local, group, offset = _local_vocab(logits)
    values, indices = local.float().topk(min(k, local.shape[-1]), dim=-1)
    indices = indices + offset
    size = dist.get_world_size(group)
    all_values = [torch.empty_like(values) for _ in range(size)]
    all_indices = [torch.empty_like(indices) for _ in range(size)]
    dist.all_gather(all_values, values.contiguous(), group=group)
    dist.all_gather(all_indices, indices.contiguous(), group=group)
    values, where = torch.cat(all_values, dim=-1).topk(k, dim=-1)
    return values, torch.cat(all_indices, dim=-1).gather(-1, where)
