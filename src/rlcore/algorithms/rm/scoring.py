"""A sequence's reward from a reward model: the scalar head's output at its last real token.

A reward model trained by ``rlcore run`` with an ``rm`` section saves a value model: Hugging Face's
``AutoModelForTokenClassification`` with one label (the trunk plus ``score = Linear(hidden, 1)``). Its forward
gives one score per position, ``logits [B, S, 1]``; the reward of a right-padded sequence of ``n`` tokens is the
score at position ``n - 1``, the hidden state that has read the whole sequence. That is what NeMo-RL's
Bradley-Terry reward model (a sequence-classification model) reads: the score at the last non-pad token.

Reading a checkpoint::

    model = AutoModelForTokenClassification.from_pretrained(path)
    logits = model(input_ids=ids, attention_mask=mask).logits  # [B, S, 1]
    rewards = last_token_scores(logits, mask.sum(-1))          # [B]

Training reads the same score through ``Policy.get_values``, whose values are shifted by one position
(``values[i]`` is the head at position ``i - 1``, design.md §2.2): :func:`scores_from_values` reads it there,
from a batch whose rows carry one more position past their last real token
(:func:`rlcore.algorithms.rm.batches.with_score_position`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def _lengths(input_lengths: torch.Tensor, rows: int, width: int, what: str) -> torch.Tensor:
    import torch

    lengths = torch.as_tensor(input_lengths).long().reshape(-1)
    if lengths.numel() != rows:
        raise ValueError(f"{what}: {lengths.numel()} input_lengths for {rows} rows")
    if rows and (int(lengths.min()) < 1 or int(lengths.max()) > width):
        raise ValueError(f"{what}: input_lengths must be within 1..{width} (the output's width): {lengths.tolist()}")
    return lengths


def last_token_scores(model_out: torch.Tensor, input_lengths: torch.Tensor) -> torch.Tensor:
    """``[B]``: each row's score at its last real token, position ``input_lengths - 1``.

    ``model_out`` is a token-classification reward model's raw output for right-padded rows, ``[B, S]`` or
    ``[B, S, 1]`` (its ``logits``); ``input_lengths`` ``[B]`` counts each row's real tokens (``attention_mask``'s
    row sums). Differentiable; keeps ``model_out``'s dtype and device.
    """
    out = model_out[..., 0] if model_out.dim() == 3 else model_out
    if out.dim() != 2:
        raise ValueError(f"last_token_scores: expected [B, S] or [B, S, 1], got shape {tuple(model_out.shape)}")
    lengths = _lengths(input_lengths, out.shape[0], out.shape[1], "last_token_scores").to(out.device)
    return out.gather(1, (lengths - 1).unsqueeze(1)).squeeze(1) if out.shape[0] else out.new_zeros(0)


def scores_from_values(values: torch.Tensor, input_lengths: torch.Tensor) -> torch.Tensor:
    """``[B]``: each row's score at its last real token, read from ``Policy.get_values``' aligned ``values``
    ``[B, S]`` of rows that carry one extra position (``input_lengths`` counts the real tokens without it):
    ``values[b, n]`` is the head at position ``n - 1``."""
    if values.dim() != 2:
        raise ValueError(f"scores_from_values: expected values [B, S], got shape {tuple(values.shape)}")
    lengths = _lengths(input_lengths, values.shape[0], values.shape[1] - 1, "scores_from_values").to(values.device)
    return values.gather(1, lengths.unsqueeze(1)).squeeze(1)
