"""Token logprobs from logits, with the alignment every backend keeps (design.md §2.2).

Position 0 is 0, position ``i`` holds ``log p(token_i | tokens_<i)`` (computed
from the logits at ``i - 1``), and positions at or beyond a sequence's length
are 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def token_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    input_lengths: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """``[B, S]`` float32 logprobs of ``input_ids`` under full-vocabulary ``logits [B, S, V]``;
    ``chunk_size`` positions at a time when given (:mod:`rlcore.training.chunked_logprobs`)."""
    import torch

    if chunk_size is not None:
        from rlcore.training.chunked_logprobs import chunked_next_token_logprobs

        return align(chunked_next_token_logprobs(logits, input_ids, chunk_size, temperature=temperature), input_lengths)
    logits = logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    # log_softmax(x)[t] = x[t] - logsumexp(x): avoids materialising a second [B, S, V] tensor.
    picked = logits.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    lp = picked - torch.logsumexp(logits, dim=-1)
    return align(lp, input_lengths)


def align(next_token_logprobs: torch.Tensor, input_lengths: torch.Tensor) -> torch.Tensor:
    """Shift ``[B, S-1, ...]`` next-token values (logprobs, or logits at given ids) to ``[B, S, ...]`` and zero
    position 0 and padding."""
    import torch

    batch, width, *rest = next_token_logprobs.shape
    out = torch.zeros(batch, width + 1, *rest, dtype=torch.float32, device=next_token_logprobs.device)
    out[:, 1:] = next_token_logprobs
    positions = torch.arange(width + 1, device=out.device)
    valid = positions[None, :] < input_lengths.to(out.device)[:, None]
    valid = valid.reshape(batch, width + 1, *[1] * len(rest))
    return torch.where(valid, out, torch.zeros_like(out))  # not a multiply: inf/NaN in padding must not leak


def topk_logits(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k logits of the next-token positions: ``[B, S-1, k]`` values and global indices."""
    values, indices = logits[:, :-1].float().topk(k, dim=-1)
    return values, indices
