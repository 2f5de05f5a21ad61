"""Context parallelism (``policy.megatron_cfg.context_parallel_size``) on megatron-core's local layer spec.

megatron-core implements context parallelism (CP) only in TransformerEngine's attention. This module does it with
the local spec, on CPU (gloo) and GPU alike, in megatron's own layout: a micro-batch padded to a multiple of
``2·cp`` is cut into ``2·cp`` chunks and CP rank ``r`` holds chunks ``r`` and ``2·cp-1-r`` (each rank then has as
much causal attention work as the others). Every rank holds the whole micro-batch; what is split is the work:

- the embedding, the norms, the MLPs and the output layer see the rank's positions only;
- rotary embeddings are taken at those global positions (:func:`rotary_at_local_positions`);
- attention: each rank's queries attend to every rank's keys and values, all-gathered over the CP group in
  :class:`rl_megatron.sdpa_attention.SdpaDotProductAttention` (:func:`gather_keys_values`), with a causal mask
  built from global positions; the gradient of the gathered keys and values is summed over the CP group;
- a mixture of experts' routers route the rank's positions; their gating logits are all-gathered for the
  load-balancing loss (:func:`gather_router_logits`, used by :class:`rl_megatron.moe.RouterLogits`);
- the logits are all-gathered into global order (:func:`gather_logits`), so logprobs and loss are computed as
  without CP on every CP rank; each rank back-propagates only its own positions' share, and megatron's DDP sums
  the weight gradients over data-parallel × CP ranks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def local_positions(width: int, cp_size: int, cp_rank: int, device: torch.device | None = None) -> torch.Tensor:
    """The global positions CP rank ``cp_rank`` holds of a ``width``-long sequence (a multiple of ``2·cp_size``):
    chunks ``cp_rank`` and ``2·cp_size-1-cp_rank``, in that order."""
    chunk = width // (2 * cp_size)
    starts = (cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk)
    return torch.cat([torch.arange(s, s + chunk, device=device) for s in starts])


def _global_order(width: int, cp_size: int, device: torch.device) -> torch.Tensor:
    """The index that puts a CP all-gather (rank 0's positions, then rank 1's, ...) back in global order."""
    gathered = torch.cat([local_positions(width, cp_size, r, device) for r in range(cp_size)])
    return torch.argsort(gathered)


class _GatherSequence(torch.autograd.Function):
    """All-gather ``x``'s local positions along ``dim`` into global order over ``group``. Backward: the gradient
    of the gathered tensor summed over the group (``sum_grads``: each rank used every rank's slice, as attention
    does with keys and values), or this rank's slice of it alone (every rank computed the same function of the
    gathered tensor, as the loss of the gathered logits)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any, sum_grads: bool) -> torch.Tensor:
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        ctx.dim, ctx.group, ctx.sum_grads, ctx.rank = dim, group, sum_grads, rank
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        width = x.shape[dim] * size
        ctx.order = _global_order(width, size, x.device)
        return torch.cat(parts, dim=dim).index_select(dim, ctx.order)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.sum_grads:  # every rank's gradient of the whole gathered tensor, summed; then this rank's part
            grad = grad.contiguous()
            dist.all_reduce(grad, group=ctx.group)
        mine = local_positions(grad.shape[ctx.dim], dist.get_world_size(ctx.group), ctx.rank, grad.device)
        return grad.index_select(ctx.dim, mine), None, None, None


def gather_keys_values(t: torch.Tensor, group: Any) -> torch.Tensor:
    """Keys or values ``[s_local, b, heads, dim]`` of every CP rank, ``[s, b, heads, dim]`` in global order."""
    return _GatherSequence.apply(t, 0, group, True)


def gather_logits(logits: torch.Tensor, group: Any) -> torch.Tensor:
    """The output layer's ``[b, s_local, v]`` logits of every CP rank, ``[b, s, v]`` in global order."""
    return _GatherSequence.apply(logits, 1, group, False)


def gather_router_logits(logits: torch.Tensor, group: Any) -> torch.Tensor:
    """A router's ``[s_local, b, experts]`` gating logits of every CP rank, ``[s, b, experts]`` in global order:
    the load-balancing loss pools every position of a sequence, and every CP rank computes it whole."""
    return _GatherSequence.apply(logits, 0, group, False)


def rotary_at_local_positions(rotary: torch.nn.Module, cp_size: int, cp_rank: int) -> None:
    """Make megatron's ``RotaryEmbedding`` return its embedding at this CP rank's global positions.

    megatron selects them itself (``get_pos_emb_on_this_cp_rank``) through a pinned CPU tensor moved with
    ``.cuda()``, which a CPU run lacks; the same selection is done here, for both."""
    full = rotary.forward
    rotary.cp_group = None  # type: ignore[assignment]  # megatron's own selection off

    def forward(max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group: Any = None) -> torch.Tensor:
        emb = full(max_seq_len, offset, packed_seq, None)  # [s, 1, 1, dim] for the whole sequence
        return emb.index_select(0, local_positions(max_seq_len, cp_size, cp_rank, emb.device))

    rotary.forward = forward


__all__ = [
    "gather_keys_values",
    "gather_logits",
    "gather_router_logits",
    "local_positions",
    "rotary_at_local_positions",
]
