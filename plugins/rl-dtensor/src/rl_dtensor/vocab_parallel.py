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

from rlcore.training.chunked_logprobs import chunked_logprobs
from rlcore.training.vocab_parallel import (
    vocab_parallel_entropy,
    vocab_parallel_gather,
    vocab_parallel_logprobs,
    vocab_parallel_logprobs_at,
    vocab_parallel_topk,
)


def shard_offset(vocab_size: int, tp_size: int, tp_rank: int) -> int:
    """First vocabulary index of a rank's slice (``torch.chunk`` semantics, as DTensor ``Shard`` uses)."""
    chunk = -(-vocab_size // tp_size)
    return min(tp_rank * chunk, vocab_size)


def _vocab_sharded(logits: DTensor) -> bool:
    """True for a DTensor on a 1-D mesh split along its last dimension (what the TP plans produce)."""
    placement = logits.placements[0]
    return (
        logits.device_mesh.ndim == 1 and isinstance(placement, Shard) and placement.dim % logits.ndim == logits.ndim - 1
    )


def _local_vocab(logits: DTensor) -> tuple[torch.Tensor, dist.ProcessGroup, int]:
    """This rank's logit slice, the tp group and the slice's first vocabulary index."""
    mesh = logits.device_mesh
    group = mesh.get_group()
    offset = shard_offset(logits.shape[-1], mesh.size(), mesh.get_local_rank())
    return logits.to_local(), group, offset


def _replicated(logits: DTensor) -> torch.Tensor:
    return logits.redistribute(placements=[Replicate()] * logits.device_mesh.ndim).to_local()


def gather_logprobs(
    logits: torch.Tensor, target: torch.Tensor, temperature: float = 1.0, chunk_size: int | None = None
) -> torch.Tensor:
    """``log_softmax(logits / temperature)[..., target]`` in float32, for plain or vocab-sharded DTensor logits,
    ``chunk_size`` positions at a time when given (``policy.logprob_chunk_size``).

    ``logits`` is ``[..., V]`` and ``target`` ``[...]`` (same leading shape).
    """
    if isinstance(logits, DTensor) and not _vocab_sharded(logits):
        logits = _replicated(logits)  # e.g. a custom plan that gathers the output
    local, group, offset = _local_vocab(logits) if isinstance(logits, DTensor) else (logits, None, 0)
    if chunk_size is not None:
        return chunked_logprobs(local, target, chunk_size, vocab_start=offset, group=group, temperature=temperature)
    if temperature != 1.0:
        local = local / temperature
    if group is not None:
        return vocab_parallel_logprobs(local, target, offset, group)
    logits = local.float()
    picked = logits.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def gather_at(logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """float32 ``logits[..., indices]`` (``indices`` ``[..., k]`` global ids) for plain or vocab-sharded DTensor
    logits, differentiable; a sharded vocabulary is never gathered."""
    if isinstance(logits, DTensor) and not _vocab_sharded(logits):
        logits = _replicated(logits)
    if not isinstance(logits, DTensor):
        return vocab_parallel_gather(logits, indices)
    local, group, offset = _local_vocab(logits)
    return vocab_parallel_gather(local, indices, offset, group)


def logprobs_at(logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """float32 full-vocabulary ``log_softmax(logits)[..., indices]`` for plain or vocab-sharded DTensor logits,
    differentiable; a sharded vocabulary is never gathered."""
    if isinstance(logits, DTensor) and not _vocab_sharded(logits):
        logits = _replicated(logits)
    if not isinstance(logits, DTensor):
        return vocab_parallel_logprobs_at(logits, indices.to(logits.device))
    local, group, offset = _local_vocab(logits)
    return vocab_parallel_logprobs_at(local, indices.to(local.device), offset, group)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """float32 entropy of ``softmax(logits)`` over the last dimension for plain or vocab-sharded DTensor logits,
    differentiable; a sharded vocabulary is never gathered."""
    if isinstance(logits, DTensor) and not _vocab_sharded(logits):
        logits = _replicated(logits)
    if not isinstance(logits, DTensor):
        return vocab_parallel_entropy(logits)
    local, group, _ = _local_vocab(logits)
    return vocab_parallel_entropy(local, group)


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
    return vocab_parallel_topk(local, k, offset, group)
