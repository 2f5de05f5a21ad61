"""The loss-function protocol every training backend calls.

Contract (design.md §2.3): a backend runs one optimizer step as a sequence of
micro-batches on each data-parallel rank. For every micro-batch it computes the
token logprobs of the current policy and calls the loss with the number of
valid tokens and sequences of the *whole optimizer step across all dp ranks*.
The loss divides by those global counts, so the backend can simply **sum**
micro-batch losses and **sum** gradients over micro-batches and dp ranks. The
result is independent of dp size, micro-batch size, dynamic batching and
sequence packing.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from rlcore.data import BatchedDataDict


class LossType(str, enum.Enum):
    """How a loss is normalised: per valid token or per valid sequence."""

    TOKEN_LEVEL = "token_level"
    SEQUENCE_LEVEL = "sequence_level"


@runtime_checkable
class LossFunction(Protocol):
    """A loss over one micro-batch, normalised by global step counts.

    Called as ``loss, metrics = loss_fn(logprobs, data, global_valid_seqs,
    global_valid_toks)`` where

    - ``logprobs`` is ``[B, S]`` float32 with the alignment of design.md §2.2:
      position 0 is 0, position ``i`` holds ``log p(token_i | tokens_<i)``,
      padding positions are 0. Backends compute it from their (possibly
      vocab-parallel) logits, so a loss never needs the full vocabulary.
    - ``data`` is the micro-batch: ``input_ids``, ``input_lengths``,
      ``token_mask [B, S]``, ``sample_mask [B]`` and whatever the loss reads
      (``advantages``, ``prev_logprobs``, ``generation_logprobs``,
      ``reference_policy_logprobs``, ...). A valid token is one where
      ``token_mask * sample_mask`` is 1 at positions ``1..S-1``.
    - ``global_valid_seqs`` / ``global_valid_toks`` are 0-d tensors holding the
      counts over the whole optimizer step on all dp ranks.

    It returns the micro-batch's share of the global loss (a 0-d tensor the
    backend calls ``backward`` on) and a dict of float metrics, each this
    micro-batch's share of the step value (summed by the caller), except names
    ending in ``_min`` / ``_max``, which are extremes (see :func:`step_metrics`).
    A metric may be a Python number or a detached 0-d tensor left on its device: the
    core loop reads a step's tensors to the host in one copy at the step's end, so a
    loss that returns tensors costs no device sync per micro-batch.

    A loss that needs more than token logprobs names it in an optional class
    attribute ``inputs`` (members of :data:`LOSS_INPUTS`, plugin API 5); the
    backend then puts each into the micro-batch under its name before the
    call, computed like the logprobs (vocab-parallel-safe, under packing and
    pipeline stages). ``Policy`` refuses such a loss for a backend that does
    not declare the matching capability.
    """

    loss_type: LossType

    def __call__(
        self,
        logprobs: torch.Tensor,
        data: BatchedDataDict[Any],
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, Any]]: ...


#: A loss input (plugin API 5, capability ``logits_at_indices``): the policy's logits at the token ids of
#: ``data['logit_indices']`` ``[B, S, k]``, as ``[B, S, k]`` float32 (differentiable). Both are aligned like
#: logprobs: position ``i`` holds the ids scored at the prediction of token ``i`` (the logits at ``i - 1``);
#: position 0 and padding are 0. On-policy distillation asks for the student's logits at the teacher's top-k ids.
LOGITS_AT_INDICES = "logits_at_indices"
#: Where a batch holds the ids of :data:`LOGITS_AT_INDICES`.
LOGIT_INDICES_KEY = "logit_indices"
#: A loss input (capability ``logprobs_at_indices``, since rlcore 0.2): ``log_softmax`` over the whole vocabulary
#: at the ids of ``data['logit_indices']``, ``[B, S, k]`` float32 (differentiable), aligned like
#: :data:`LOGITS_AT_INDICES`. Distillation with ``zero_outside_topk`` asks for it (no renormalisation over the k ids).
LOGPROBS_AT_INDICES = "logprobs_at_indices"
#: A loss input (capability ``entropy``, since rlcore 0.2): the entropy ``-sum_v p log p`` of the policy's
#: next-token distribution over the whole vocabulary, ``[B, S]`` float32 (differentiable), aligned like logprobs
#: (position ``i``: the distribution that predicts token ``i``; position 0 and padding are 0).
ENTROPY = "entropy"
#: Every input a loss may declare, and the capability a backend needs to provide it.
LOSS_INPUTS = {LOGITS_AT_INDICES: "logits_at_indices", LOGPROBS_AT_INDICES: "logprobs_at_indices", ENTROPY: "entropy"}


def loss_inputs(loss_fn: object) -> tuple[str, ...]:
    """The extra inputs ``loss_fn`` declares (empty for a loss of token logprobs only); ValueError for a name
    rlcore does not know."""
    names = tuple(getattr(loss_fn, "inputs", ()) or ())
    unknown = [n for n in names if n not in LOSS_INPUTS]
    if unknown:
        raise ValueError(
            f"{type(loss_fn).__name__}.inputs names {unknown}; a loss may ask for {', '.join(LOSS_INPUTS)}"
        )
    return names


def step_metrics(per_micro_batch: Mapping[str, Sequence[float]], steps: int) -> dict[str, float]:
    """One value per loss metric for ``steps`` optimizer steps, from every micro-batch's value on every rank.

    ``*_min`` / ``*_max`` are the smallest / largest finite value (an empty
    micro-batch reports +-inf; nan when no micro-batch had a valid token);
    every other metric is summed and divided by ``steps``: the mean of its
    step values.
    """
    out = {}
    for name, values in per_micro_batch.items():
        extreme = min if name.endswith("_min") else max if name.endswith("_max") else None
        if extreme is None:
            out[name] = sum(values) / steps
        else:
            finite = [v for v in values if math.isfinite(v)]
            out[name] = extreme(finite) if finite else math.nan
    return out
