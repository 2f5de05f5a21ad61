"""Reward-model samples as training batches: DPO's preference pairs, each row with one more position for its score.

A sample is read and tokenized as a DPO pair (:func:`rlcore.algorithms.dpo.batches.preference_pair`, the ``rm``
section's ``add_bos`` / ``add_eos`` / ``add_generation_prompt``): rows ``2i`` / ``2i+1`` hold the chosen and the
rejected sequence, ``group_size = 2`` keeps them together through sharding and every micro-batch plan.

A value model's ``values[i]`` is the head at position ``i - 1`` (design.md §2.2), so the head's output at a
sequence's last real token, its reward, would fall past the row's length. :func:`with_score_position` therefore
appends one pad token to every row (``input_lengths + 1``); causal attention leaves the real tokens' hidden states as
they were, and ``values[n]`` of a row of ``n`` real tokens is the reward
(:func:`rlcore.algorithms.rm.scoring.scores_from_values`). A pair whose longer sequence does not fit
``policy.max_total_sequence_length`` with that position (or is longer than ``data.max_input_seq_length``, when set)
is cut and masked as a whole, as DPO's are.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from rlcore.algorithms.sft.batches import LengthRule

if TYPE_CHECKING:
    from rlcore.data import BatchedDataDict
    from rlcore.datasets import Sample


def length_rule(cfg: Any) -> LengthRule:
    """DPO's rule for pairs, less the score position when the limit is the policy's sequence length."""
    rule = LengthRule.of(cfg, pairs=True)
    if rule.setting == "policy.max_total_sequence_length":
        return dataclasses.replace(rule, limit=rule.limit - 1, setting=f"{rule.setting} less the score position")
    return rule


def with_score_position(batch: BatchedDataDict, pad: int) -> BatchedDataDict:
    """``batch`` with one pad token appended to every row (``input_lengths + 1``, ``token_mask`` 0 there): the
    value model's ``values[n]`` of a row of ``n`` real tokens is then the head at its last real token."""
    import torch

    ids, lengths = batch["input_ids"], batch["input_lengths"]
    rows = ids.shape[0]
    wider = torch.full((rows, ids.shape[1] + 1), pad, dtype=ids.dtype)
    wider[:, :-1] = ids
    wider[torch.arange(rows), lengths] = pad  # right padding already holds pad; the row's extra position too
    batch["input_ids"] = wider
    batch["token_mask"] = torch.nn.functional.pad(batch["token_mask"], (0, 1))
    batch["input_lengths"] = lengths + 1
    return batch


def rm_batch(samples: list[Sample], tokenizer: Any, cfg: Any, size: int | None = None) -> BatchedDataDict:
    """``2 * size`` rows (``size`` pairs, default ``len(samples)``; the extra pairs masked fillers), chosen then
    rejected, each with its score position (:func:`with_score_position`); ``group_size`` 2."""
    from rlcore.algorithms.dpo.batches import pair_batch
    from rlcore.run.prompts import pad_id

    return with_score_position(pair_batch(samples, tokenizer, cfg, length_rule(cfg), size), pad_id(tokenizer))


def nothing_preferred(samples: list[Sample], tokenizer: Any, cfg: Any) -> str | None:
    """Why no pair of ``samples`` trains anything (each has its chosen response equal to its rejected one, or is
    cut by :func:`length_rule`), or None as soon as one does (DPO's reasons)."""
    from rlcore.algorithms.dpo import batches

    return batches.nothing_preferred(samples, tokenizer, cfg, length_rule(cfg), batches.differs)
