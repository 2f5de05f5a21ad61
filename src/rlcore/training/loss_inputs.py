"""How a backend computes the inputs a loss may ask for beyond token logprobs (plugin API 5; the names and
their contract: :mod:`rlcore.interfaces.loss`).

``logits_at_indices`` comes from whatever logits the backend holds, whole or
split over tensor-parallel ranks (:func:`rlcore.training.vocab_parallel.vocab_parallel_gather`),
without gathering the vocabulary.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from rlcore.interfaces.loss import LOGIT_INDICES_KEY, LOGITS_AT_INDICES, LOSS_INPUTS, loss_inputs

__all__ = ["LOGITS_AT_INDICES", "LOGIT_INDICES_KEY", "LOSS_INPUTS", "logits_at_indices", "loss_inputs",
           "next_position_indices"]


def next_position_indices(indices: "torch.Tensor") -> "torch.Tensor":
    """``[B, S, k]`` aligned ids → ``[B, S-1, k]``: column ``t`` holds the ids scored by the logits at ``t``."""
    return indices[:, 1:]


def logits_at_indices(logits: "torch.Tensor", data: Any, vocab_start: int = 0, group: Any = None) -> "torch.Tensor":
    """The aligned ``[B, S, k]`` float32 logits at ``data['logit_indices']`` from ``[B, S', V_local]`` logits
    (``S' >= S - 1``; a tensor-parallel slice starting at ``vocab_start`` when ``group`` is given)."""
    from rlcore.training.logprobs import align
    from rlcore.training.vocab_parallel import vocab_parallel_gather

    if LOGIT_INDICES_KEY not in data:
        raise KeyError(f"the loss asks for {LOGITS_AT_INDICES}, which needs data[{LOGIT_INDICES_KEY!r}] "
                       "([B, S, k] token ids)")
    indices = next_position_indices(data[LOGIT_INDICES_KEY])
    width = indices.shape[1]
    picked = vocab_parallel_gather(logits[:, :width], indices, vocab_start, group)
    return align(picked, data["input_lengths"])
