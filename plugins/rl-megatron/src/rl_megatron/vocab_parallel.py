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

from rlcore.training.chunked_logprobs import chunked_next_token_logprobs
from rlcore.training.vocab_parallel import vocab_parallel_logprobs, vocab_parallel_topk


def mask_padded_vocab(logits: torch.Tensor, vocab_start: int, vocab_size: int) -> torch.Tensor:
    """``logits`` with columns of padded vocabulary rows (global id >= ``vocab_size``) set to -inf."""
    local_size = logits.shape[-1]
    if vocab_start + local_size <= vocab_size:
        return logits
    ids = torch.arange(vocab_start, vocab_start + local_size, device=logits.device)
    return logits.masked_fill(ids >= vocab_size, float("-inf"))


def token_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    group: Any,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """``[B, S-1]`` float32 ``log p(token_{i+1} | tokens_<=i)`` under ``softmax(logits / temperature)`` from
    ``[B, S, V/tp]`` logits (differentiable), ``chunk_size`` positions at a time when given."""
    if chunk_size is not None:  # no float32 copy of the whole slice: each chunk is upcast on its own
        return chunked_next_token_logprobs(
            mask_padded_vocab(logits, vocab_start, vocab_size),
            input_ids,
            chunk_size,
            vocab_start=vocab_start,
            group=group,
            temperature=temperature,
        )
    logits = logits[:, :-1].float()  # before the temperature: bf16 logits (defer_fp32_logits) divide in float32
    if temperature != 1.0:
        logits = logits / temperature
    logits = mask_padded_vocab(logits, vocab_start, vocab_size)
    return vocab_parallel_logprobs(logits, input_ids[:, 1:], vocab_start, group)


def topk(
    logits: torch.Tensor, k: int, vocab_start: int, vocab_size: int, group: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of the next-token positions: ``[B, S-1, k]`` values and global token ids.

    Each rank takes its local top-k, the candidates are all-gathered and the
    global top-k is taken among them (the global top-k is always among the
    union of the local ones).
    """
    logits = mask_padded_vocab(logits[:, :-1].float(), vocab_start, vocab_size)
    return vocab_parallel_topk(logits, k, vocab_start, group)


__all__ = ["mask_padded_vocab", "token_logprobs", "topk"]
