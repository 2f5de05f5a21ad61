"""Logprobs and top-k over a vocabulary split across tensor-parallel ranks.

Each rank holds a slice ``[vocab_start, vocab_start + V_local)`` of the
logits. The full ``[B, S, V]`` tensor is never gathered: log-softmax needs
only the global max, the global sum of exponentials and the target's logit
(three small all-reduces over the group); the backward pass is local
(softmax minus one-hot on this rank's slice). Top-k takes each rank's local
top-k and reduces the gathered candidates (the global top-k is always among
them). Shared by the backends that shard the vocabulary (dtensor, megatron).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class VocabParallelLogprob(torch.autograd.Function):
    """``log_softmax(x)[target]`` where ``x``'s last dimension is split across ``group``."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, target: torch.Tensor, vocab_start: int, group: Any) -> torch.Tensor:
        ctx.input_dtype = local.dtype
        local = local.float()
        vocab_local = local.shape[-1]
        row_max = local.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = local - row_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=group)

        index = target - vocab_start
        here = (index >= 0) & (index < vocab_local)
        picked = shifted.gather(-1, index.clamp(0, vocab_local - 1).unsqueeze(-1)).squeeze(-1)
        picked = torch.where(here, picked, torch.zeros_like(picked))
        dist.all_reduce(picked, op=dist.ReduceOp.SUM, group=group)

        exp.div_(sum_exp.unsqueeze(-1))  # now the softmax of this slice, kept for backward
        ctx.save_for_backward(exp, index, here)
        return picked - sum_exp.log()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, index, here = ctx.saved_tensors
        grad_local = -softmax * grad.unsqueeze(-1)
        onehot = torch.zeros_like(grad_local)
        onehot.scatter_(-1, index.clamp(0, softmax.shape[-1] - 1).unsqueeze(-1), (grad * here).unsqueeze(-1))
        return (grad_local + onehot).to(ctx.input_dtype), None, None, None


class VocabParallelGather(torch.autograd.Function):
    """``x[..., indices]`` (float32) where ``x``'s last dimension is split across ``group``: each rank picks the
    ids in its slice, one all-reduce sums them. Every rank then computes the same loss, so the backward is local:
    the gradient of each picked logit goes to the rank that holds it."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, indices: torch.Tensor, vocab_start: int, group: Any) -> torch.Tensor:
        vocab_local = local.shape[-1]
        index = indices - vocab_start
        here = (index >= 0) & (index < vocab_local)
        index = index.clamp(0, vocab_local - 1)
        picked = local.float().gather(-1, index)
        picked = torch.where(here, picked, torch.zeros_like(picked))
        if group is not None:
            dist.all_reduce(picked, op=dist.ReduceOp.SUM, group=group)
        ctx.save_for_backward(index, here)
        ctx.input_shape, ctx.input_dtype = local.shape, local.dtype
        return picked

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        index, here = ctx.saved_tensors
        grad_local = torch.zeros(ctx.input_shape, dtype=torch.float32, device=grad.device)
        grad_local.scatter_add_(-1, index, torch.where(here, grad, torch.zeros_like(grad)))
        return grad_local.to(ctx.input_dtype), None, None, None


def vocab_parallel_gather(
    local: torch.Tensor, indices: torch.Tensor, vocab_start: int = 0, group: Any = None
) -> torch.Tensor:
    """float32 logits at global vocabulary ``indices`` ``[..., k]`` from this rank's slice (differentiable);
    ``group`` None: ``local`` is the whole vocabulary."""
    return VocabParallelGather.apply(local, indices.to(local.device), vocab_start, group)


def vocab_parallel_logprobs(local: torch.Tensor, target: torch.Tensor, vocab_start: int, group: Any) -> torch.Tensor:
    """float32 ``log_softmax(logits)[..., target]`` from this rank's vocabulary slice (differentiable)."""
    return VocabParallelLogprob.apply(local, target.to(local.device), vocab_start, group)


def vocab_parallel_topk(local: torch.Tensor, k: int, vocab_start: int, group: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Global top-k float32 values and global vocabulary ids over the last dimension."""
    values, indices = local.float().topk(min(k, local.shape[-1]), dim=-1)
    indices = indices + vocab_start
    size = dist.get_world_size(group)
    if size > 1:
        all_values = [torch.empty_like(values) for _ in range(size)]
        all_indices = [torch.empty_like(indices) for _ in range(size)]
        dist.all_gather(all_values, values.contiguous(), group=group)
        dist.all_gather(all_indices, indices.contiguous(), group=group)
        values, indices = torch.cat(all_values, dim=-1), torch.cat(all_indices, dim=-1)
    best, order = values.topk(k, dim=-1)
    return best, indices.gather(-1, order)


class VocabParallelLogsumexp(torch.autograd.Function):
    """float32 ``logsumexp(x)`` over a last dimension split across ``group`` (None: ``x`` is whole): two
    all-reduces (max, sum of exponentials); the backward is local (``grad * softmax`` on this rank's slice)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.input_dtype = local.dtype
        softmax, log_sum = _softmax_and_log_sum(local.float(), group)
        ctx.save_for_backward(softmax)
        return log_sum

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (softmax,) = ctx.saved_tensors
        return (softmax * grad.unsqueeze(-1)).to(ctx.input_dtype), None


class VocabParallelEntropy(torch.autograd.Function):
    """float32 entropy ``-sum p log p`` of ``softmax(x)`` over a last dimension split across ``group``: three
    all-reduces (max, sum of exponentials, ``sum p x``). With ``E = sum p x`` the entropy is ``logsumexp - E``
    and its gradient ``-p (x - E)``, local to each rank's slice."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.input_dtype = local.dtype
        x = local.float()
        softmax, log_sum = _softmax_and_log_sum(x, group)
        # p * x with p = 0 at -inf logits (a padded vocabulary row) counts 0, not nan
        weighted = torch.where(softmax > 0, softmax * x, torch.zeros_like(x))
        expected = weighted.sum(-1)
        if group is not None:
            dist.all_reduce(expected, op=dist.ReduceOp.SUM, group=group)
        ctx.save_for_backward(softmax, x, expected)
        return log_sum - expected

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        softmax, x, expected = ctx.saved_tensors
        centred = torch.where(softmax > 0, x - expected.unsqueeze(-1), torch.zeros_like(x))
        return (-softmax * centred * grad.unsqueeze(-1)).to(ctx.input_dtype), None


def _softmax_and_log_sum(x: torch.Tensor, group: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """This slice's share of the global softmax of float32 ``x`` and the global ``logsumexp`` (max and sum of
    exponentials all-reduced over ``group``)."""
    row_max = x.max(dim=-1).values
    if group is not None:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    exp = (x - row_max.unsqueeze(-1)).exp()
    sum_exp = exp.sum(dim=-1)
    if group is not None:
        dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=group)
    return exp / sum_exp.unsqueeze(-1), row_max + sum_exp.log()


def vocab_parallel_logsumexp(local: torch.Tensor, group: Any = None) -> torch.Tensor:
    """float32 ``logsumexp`` over the whole vocabulary from this rank's slice (differentiable; ``group`` None:
    ``local`` is the whole vocabulary)."""
    return VocabParallelLogsumexp.apply(local, group)


def vocab_parallel_entropy(local: torch.Tensor, group: Any = None) -> torch.Tensor:
    """float32 entropy of ``softmax`` over the whole vocabulary from this rank's slice (differentiable)."""
    return VocabParallelEntropy.apply(local, group)


def vocab_parallel_logprobs_at(
    local: torch.Tensor, indices: torch.Tensor, vocab_start: int = 0, group: Any = None
) -> torch.Tensor:
    """float32 ``log_softmax(x)[..., indices]`` over the whole vocabulary (``indices`` ``[..., k]`` global ids)
    from this rank's slice (differentiable): the gathered logits minus the global ``logsumexp``."""
    return vocab_parallel_gather(local, indices, vocab_start, group) - vocab_parallel_logsumexp(local, group)[..., None]
