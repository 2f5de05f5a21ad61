"""Token logprobs and top-k from vocabulary-parallel logits (each TP rank holds a slice of the vocabulary).

The full ``[B, S, V]`` logits are never gathered: log-softmax needs only the
global max, the global sum of exponentials and the target's logit, three
small all-reduces over the tensor-parallel group. The backward pass is local
(softmax minus one-hot on this rank's slice). Padded vocabulary rows (the
vocabulary is padded to a multiple of the TP size) are masked to ``-inf`` so
they carry no probability.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class _VocabParallelLogprobs(torch.autograd.Function):
    """``log softmax(logits)[target]`` over a vocabulary split across ``group``."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, vocab_start: int, group: Any) -> torch.Tensor:
        logits = logits.float()
        maximum = logits.max(dim=-1).values
        dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - maximum.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=group)

        local = target - vocab_start
        in_range = (local >= 0) & (local < logits.shape[-1])
        local = torch.where(in_range, local, torch.zeros_like(local))
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * in_range
        dist.all_reduce(picked, op=dist.ReduceOp.SUM, group=group)

        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local, in_range)
        return picked - sum_exp.log()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, local, in_range = ctx.saved_tensors
        grad_logits = softmax * -grad.unsqueeze(-1)
        grad_logits.scatter_add_(-1, local.unsqueeze(-1), (grad * in_range).unsqueeze(-1))
        return grad_logits, None, None, None


def mask_padded_vocab(logits: torch.Tensor, vocab_start: int, vocab_size: int) -> torch.Tensor:
    """``logits`` with columns of padded vocabulary rows (global id >= ``vocab_size``) set to -inf."""
    local_size = logits.shape[-1]
    if vocab_start + local_size <= vocab_size:
        return logits
    ids = torch.arange(vocab_start, vocab_start + local_size, device=logits.device)
    return logits.masked_fill(ids >= vocab_size, float("-inf"))


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, vocab_start: int, vocab_size: int,
                   group: Any) -> torch.Tensor:
    """``[B, S-1]`` float32 ``log p(token_{i+1} | tokens_<=i)`` from ``[B, S, V/tp]`` logits (differentiable)."""
    logits = mask_padded_vocab(logits[:, :-1].float(), vocab_start, vocab_size)
    return _VocabParallelLogprobs.apply(logits, input_ids[:, 1:], vocab_start, group)


def topk(logits: torch.Tensor, k: int, vocab_start: int, vocab_size: int, group: Any,
         group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of the next-token positions: ``[B, S-1, k]`` values and global token ids.

    Each rank takes its local top-k, the candidates are all-gathered and the
    global top-k is taken among them (the global top-k is always among the
    union of the local ones).
    """
    logits = mask_padded_vocab(logits[:, :-1].float(), vocab_start, vocab_size)
    values, indices = logits.topk(min(k, logits.shape[-1]), dim=-1)
    indices = indices + vocab_start
    if group_size > 1:
        all_values = [torch.empty_like(values) for _ in range(group_size)]
        all_indices = [torch.empty_like(indices) for _ in range(group_size)]
        dist.all_gather(all_values, values.contiguous(), group=group)
        dist.all_gather(all_indices, indices.contiguous(), group=group)
        values, indices = torch.cat(all_values, dim=-1), torch.cat(all_indices, dim=-1)
    best, order = values.topk(k, dim=-1)
    return best, indices.gather(-1, order)


__all__ = ["mask_padded_vocab", "token_logprobs", "topk"]
