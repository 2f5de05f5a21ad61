"""How a backend computes the inputs a loss may ask for beyond token logprobs (since rlcore 0.2; the names and
their contract: :mod:`rlcore.interfaces.loss`).

``logits_at_indices``, ``logprobs_at_indices`` and ``entropy`` come from whatever logits the backend holds,
whole or split over tensor-parallel ranks (:mod:`rlcore.training.vocab_parallel`: a masked gather and small
all-reduces of per-position sums), without gathering the vocabulary. :func:`compute_loss_inputs` computes any of
them by name; a backend that shards the vocabulary passes its slice's first id and its tensor-parallel group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from rlcore.interfaces.loss import (
    ENTROPY,
    LOGIT_INDICES_KEY,
    LOGITS_AT_INDICES,
    LOGPROBS_AT_INDICES,
    LOSS_INPUTS,
    loss_inputs,
)

__all__ = [
    "ENTROPY",
    "LOGITS_AT_INDICES",
    "LOGIT_INDICES_KEY",
    "LOGPROBS_AT_INDICES",
    "LOSS_INPUTS",
    "compute_loss_inputs",
    "entropy",
    "logits_at_indices",
    "logprobs_at_indices",
    "loss_inputs",
    "next_position_indices",
]


def next_position_indices(indices: torch.Tensor) -> torch.Tensor:
    """``[B, S, k]`` aligned ids → ``[B, S-1, k]``: column ``t`` holds the ids scored by the logits at ``t``."""
    return indices[:, 1:]


def logits_at_indices(logits: torch.Tensor, data: Any, vocab_start: int = 0, group: Any = None) -> torch.Tensor:
    """The aligned ``[B, S, k]`` float32 logits at ``data['logit_indices']`` from ``[B, S', V_local]`` logits
    (``S' >= S - 1``; a tensor-parallel slice starting at ``vocab_start`` when ``group`` is given)."""
    from rlcore.training.logprobs import align
    from rlcore.training.vocab_parallel import vocab_parallel_gather

    indices = _next_indices(data, LOGITS_AT_INDICES)
    picked = vocab_parallel_gather(logits[:, : indices.shape[1]], indices, vocab_start, group)
    return align(picked, data["input_lengths"])


def logprobs_at_indices(logits: torch.Tensor, data: Any, vocab_start: int = 0, group: Any = None) -> torch.Tensor:
    """The aligned ``[B, S, k]`` float32 full-vocabulary logprobs at ``data['logit_indices']`` (as
    :func:`logits_at_indices`, minus each position's ``logsumexp`` over the whole, possibly split, vocabulary)."""
    from rlcore.training.logprobs import align
    from rlcore.training.vocab_parallel import vocab_parallel_logprobs_at

    indices = _next_indices(data, LOGPROBS_AT_INDICES)
    picked = vocab_parallel_logprobs_at(logits[:, : indices.shape[1]], indices, vocab_start, group)
    return align(picked, data["input_lengths"])


def entropy(logits: torch.Tensor, data: Any, vocab_start: int = 0, group: Any = None) -> torch.Tensor:
    """The aligned ``[B, S]`` float32 entropy of each position's next-token distribution over the whole (possibly
    split) vocabulary: position ``i`` holds that of the logits at ``i - 1``; position 0 and padding are 0."""
    from rlcore.training.logprobs import align
    from rlcore.training.vocab_parallel import vocab_parallel_entropy

    width = data["input_ids"].shape[1] - 1
    return align(vocab_parallel_entropy(logits[:, :width], group), data["input_lengths"])


def compute_loss_inputs(
    logits: torch.Tensor, data: Any, names: tuple[str, ...], vocab_start: int = 0, group: Any = None
) -> dict[str, torch.Tensor]:
    """``{name: the loss input}`` for each of ``names`` from ``[B, S', V_local]`` logits (``S' >= S - 1``)."""
    compute = {LOGITS_AT_INDICES: logits_at_indices, LOGPROBS_AT_INDICES: logprobs_at_indices, ENTROPY: entropy}
    return {name: compute[name](logits, data, vocab_start, group) for name in names}


def _next_indices(data: Any, name: str) -> torch.Tensor:
    if LOGIT_INDICES_KEY not in data:
        raise KeyError(f"the loss asks for {name}, which needs data[{LOGIT_INDICES_KEY!r}] ([B, S, k] token ids)")
    return next_position_indices(data[LOGIT_INDICES_KEY])
