"""Token logprobs computed a chunk of positions at a time (``policy.logprob_chunk_size``).

The plain computation upcasts the whole ``[B, S, V]`` logits to float32 and
keeps their softmax for the backward pass: for a 150k vocabulary and 16k
tokens that is two 10 GB tensors beside the logits themselves. Here the
positions are taken ``chunk_size`` at a time: the forward keeps only each
position's log-normaliser, and the backward recomputes the softmax of one chunk
at a time, so the float32 working set is ``chunk_size x V`` whatever the
sequence length (NeMo-RL's ``logprob_chunk_size`` has the same meaning).

The vocabulary may be split across a tensor-parallel group (each rank holds
``[vocab_start, vocab_start + V_local)``, as in :mod:`rlcore.training.vocab_parallel`);
``group=None`` is the whole vocabulary on this rank. The result and its
gradient equal the unchunked computation's (same float32 arithmetic per
position); only the peak memory differs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _all_reduce(tensor: torch.Tensor, op: Any, group: Any) -> None:
    if group is not None:
        dist.all_reduce(tensor, op=op, group=group)


def _upcast(chunk: torch.Tensor, temperature: float) -> torch.Tensor:
    """A float32 copy of ``chunk / temperature``: the one ``chunk x V`` working tensor, changed in place after."""
    x = chunk.to(torch.float32, copy=True)
    return x.div_(temperature) if temperature != 1.0 else x


def _chunk_statistics(
    x: torch.Tensor, index: torch.Tensor, here: torch.Tensor, group: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log-normaliser, target logit)`` per row of one float32 chunk ``x [rows, V_local]`` (consumed)."""
    picked = x.gather(-1, index.clamp(0, x.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    picked = torch.where(here, picked, torch.zeros_like(picked))
    _all_reduce(picked, dist.ReduceOp.SUM, group)
    row_max = x.max(dim=-1).values
    _all_reduce(row_max, dist.ReduceOp.MAX, group)
    sum_exp = x.sub_(row_max.unsqueeze(-1)).exp_().sum(dim=-1)
    _all_reduce(sum_exp, dist.ReduceOp.SUM, group)
    return row_max + sum_exp.log(), picked


def _chunks(sequences: torch.Tensor, chunk_size: int):
    """``(sequence, positions)`` of every chunk of ``sequences [N, S, V]``; each chunk is a view, never a copy
    (a caller's ``logits[:, :-1]`` is not contiguous, so the positions are not flattened across sequences)."""
    for n in range(sequences.shape[0]):
        for start in range(0, sequences.shape[1], chunk_size):
            yield n, slice(start, start + chunk_size)


class ChunkedLogprob(torch.autograd.Function):
    """``log_softmax(x / temperature)[target]`` over ``x [..., S, V_local]``, ``chunk_size`` positions at a time."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        chunk_size: int,
        vocab_start: int,
        group: Any,
        temperature: float,
    ) -> torch.Tensor:
        sequences = logits.reshape(-1, *logits.shape[-2:])  # a view for [B, S, V] and [S, V]
        index = target.reshape(sequences.shape[:2]).to(logits.device) - vocab_start
        here = (index >= 0) & (index < sequences.shape[-1])
        normaliser = torch.empty(sequences.shape[:2], dtype=torch.float32, device=logits.device)
        out = torch.empty_like(normaliser)
        for n, part in _chunks(sequences, chunk_size):
            x = _upcast(sequences[n, part], temperature)
            normaliser[n, part], picked = _chunk_statistics(x, index[n, part], here[n, part], group)
            out[n, part] = picked - normaliser[n, part]
        ctx.save_for_backward(logits, index, here, normaliser)
        ctx.chunk_size, ctx.temperature = chunk_size, temperature
        return out.reshape(target.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, index, here, normaliser = ctx.saved_tensors
        sequences = logits.reshape(-1, *logits.shape[-2:])
        grad = grad.reshape(normaliser.shape)
        grad_logits = torch.empty_like(sequences)  # the logits' dtype: no float32 copy of the whole vocabulary
        for n, part in _chunks(sequences, ctx.chunk_size):
            g = grad[n, part].float()
            d = _upcast(sequences[n, part], ctx.temperature).sub_(normaliser[n, part].unsqueeze(-1)).exp_()
            d.mul_(-g.unsqueeze(-1))  # d logp / d x = onehot - softmax, times the incoming gradient
            d.scatter_add_(
                -1, index[n, part].clamp(0, sequences.shape[-1] - 1).unsqueeze(-1), (g * here[n, part]).unsqueeze(-1)
            )
            if ctx.temperature != 1.0:
                d.div_(ctx.temperature)
            grad_logits[n, part] = d  # cast to the logits' dtype on the copy
        return grad_logits.reshape(logits.shape), None, None, None, None, None


def chunked_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    chunk_size: int,
    *,
    vocab_start: int = 0,
    group: Any = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """float32 ``log_softmax(logits / temperature)[..., target]`` (differentiable), ``chunk_size`` positions
    at a time; ``logits [..., V_local]`` may be this rank's slice of a vocabulary split over ``group``."""
    if chunk_size < 1:
        raise ValueError(f"logprob chunk size must be a positive number of positions, got {chunk_size}")
    return ChunkedLogprob.apply(logits, target, chunk_size, vocab_start, group, temperature)


def chunked_next_token_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    chunk_size: int,
    *,
    vocab_start: int = 0,
    group: Any = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """``[B, S-1]`` float32 ``log p(token_{i+1} | tokens_<=i)`` from ``[B, S, V_local]`` logits, ``chunk_size``
    positions at a time. Every position is computed, the last against a dummy target: slicing the logits to
    ``[:, :-1]`` first would cost the backward a zero-filled copy of the whole gradient."""
    targets = torch.cat([input_ids[:, 1:], input_ids[:, :1]], dim=1)
    lp = chunked_logprobs(logits, targets, chunk_size, vocab_start=vocab_start, group=group, temperature=temperature)
    return lp[:, :-1]


__all__ = ["ChunkedLogprob", "chunked_logprobs", "chunked_next_token_logprobs"]
