"""DPO samples as training batches: each preference pair as two sequences, chosen then rejected, kept together.

A sample is a prompt (its message log, as for GRPO and SFT) and two responses,
read from its row in either of NeMo-RL's shapes:

- binary: ``chosen`` and ``rejected`` columns, each a text (the assistant's
  reply) or a list of messages, beside the prompt (``data.input_key``, or a
  message log under ``data.messages_key``);
- ranked (NeMo-RL's ``PreferenceDataset``): the prompt under
  ``data.messages_key`` (e.g. ``context``) and ``completions``, a list of
  ``{rank, completion}`` of which the lowest rank is chosen and the next one
  rejected.

Both sequences of a pair are tokenized like SFT samples (:func:`encode_conversation`), the loss mask on the
response only, and sit in rows ``2i`` / ``2i+1`` of a batch marked ``group_size = 2``, so sharding and every
micro-batch plan keep them together. A pair with a sequence longer than ``policy.max_total_sequence_length``
(or, when set, ``data.max_input_seq_length``: NeMo-RL's ``preference_preprocessor``, which cuts each message of
both to ``min(4, limit // messages)`` tokens) is cut and masked as a whole. A pair whose chosen response
equals its rejected one trains nothing either (the preference loss of two equal sequences has no gradient),
unless ``dpo.sft_loss_weight`` trains the chosen one; a step without a pair that trains stops the run
(:func:`nothing_preferred` says why), and so does a file without one, before anything starts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rlcore.algorithms.sft.batches import LengthRule, cut_reason, encode_messages, padded_batch
from rlcore.datasets.files import DataError

if TYPE_CHECKING:
    from rlcore.data import BatchedDataDict
    from rlcore.datasets import Sample

Messages = list[dict[str, str]]


def _response(value: Any, where: str, key: str) -> Messages:
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    if (
        isinstance(value, list)
        and value
        and all(isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") for m in value)
    ):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise DataError(f"{where}: '{key}' must be a text or a list of {{role, content}} messages")


def preference_pair(sample: Sample, where: str) -> tuple[Messages, Messages, Messages]:
    """``(prompt, chosen, rejected)`` message logs of a DPO sample (see the module docstring)."""
    row = sample.metadata
    at = f"{where}: row {sample.idx + 1}"
    if "chosen" in row and "rejected" in row:
        return list(sample.messages), _response(row["chosen"], at, "chosen"), _response(row["rejected"], at, "rejected")
    completions = row.get("completions")
    if isinstance(completions, list) and len(completions) >= 2:
        try:
            ranked = sorted(completions, key=lambda c: c["rank"])
            return (
                list(sample.messages),
                _response(ranked[0]["completion"], at, "completions"),
                _response(ranked[1]["completion"], at, "completions"),
            )
        except (KeyError, TypeError):
            raise DataError(f"{at}: each of 'completions' needs a 'rank' and a 'completion'") from None
    raise DataError(
        f"{at}: a DPO sample needs 'chosen' and 'rejected' responses, or 'completions' (at least two, "
        "ranked); the row has " + ", ".join(map(str, row))
    )


def dpo_batch(samples: list[Sample], tokenizer: Any, cfg: Any, size: int | None = None) -> BatchedDataDict:
    """``2 * size`` rows (``size`` pairs, default ``len(samples)``; the extra pairs masked fillers): right-padded
    ``input_ids``, ``input_lengths``, ``token_mask`` (the response), ``sample_mask``; ``group_size`` 2."""
    return pair_batch(samples, tokenizer, cfg, LengthRule.of(cfg, pairs=True), size)


def pair_batch(
    samples: list[Sample], tokenizer: Any, cfg: Any, rule: LengthRule, size: int | None = None
) -> BatchedDataDict:
    """:func:`dpo_batch` with the length rule ``rule`` (a reward model keeps one position more)."""
    from rlcore.run.prompts import pad_id

    rows, keep = [], []
    for sample in samples:
        pair = encoded_pair(sample, tokenizer, cfg)
        fits = not rule.too_long(max(sum(len(ids) for ids, _ in chunks) for chunks in pair))
        rows += [rule.fitted(chunks, not fits) for chunks in pair]
        keep += [fits, fits]
    size = size or len(samples)
    rows += rows[-2:] * (size - len(samples))  # filler pairs, masked out
    keep += [False, False] * (size - len(samples))
    batch = padded_batch(rows, keep, pad_id(tokenizer))
    batch.group_size = 2
    return batch


def encoded_pair(sample: Sample, tokenizer: Any, cfg: Any) -> list[list[tuple[list[int], list[int]]]]:
    """The chosen and the rejected sequence of a pair, message by message (:func:`encode_messages`, by the
    algorithm's section: ``dpo``, ``rm``), the loss mask on the response."""
    prompt, *responses = preference_pair(sample, "data.train")
    return [
        encode_messages(
            tokenizer,
            prompt + response,
            cfg.algorithm_section,
            cfg.policy.tokenizer.chat_template_kwargs,
            trained=[False] * len(prompt) + [True] * len(response),
        )
        for response in responses
    ]


def differs(sample: Sample, cfg: Any) -> bool:
    """Whether a pair's chosen response differs from its rejected one (a preference to learn)."""
    _, chosen, rejected = preference_pair(sample, "data.train")
    return chosen != rejected


def teaches(sample: Sample, cfg: Any) -> bool:
    """Whether a DPO pair has something to learn whatever its length: its chosen response differs from its
    rejected one, or ``dpo.sft_loss_weight`` trains the chosen one anyway."""
    return differs(sample, cfg) or cfg.dpo.sft_loss_weight > 0


def nothing_preferred(
    samples: list[Sample],
    tokenizer: Any,
    cfg: Any,
    rule: LengthRule | None = None,
    learns_from: Callable[[Sample, Any], bool] = teaches,
) -> str | None:
    """Why no pair of ``samples`` trains anything (``learns_from`` says no, by default :func:`teaches`, or a
    sequence is cut by ``rule``, by default DPO's :class:`~rlcore.algorithms.sft.batches.LengthRule`), or None as
    soon as one does."""
    rule, same, cut = rule or LengthRule.of(cfg, pairs=True), 0, []
    for sample in samples:
        if not learns_from(sample, cfg):
            same += 1
            continue
        longest = max(sum(len(ids) for ids, _ in chunks) for chunks in encoded_pair(sample, tokenizer, cfg))
        if not rule.too_long(longest):
            return None
        cut.append(longest)
    count, differ = len(samples), "give each pair two different responses"
    if same == count:
        return (
            f"in all {count} pairs the chosen response equals the rejected one, so the preference loss has "
            f"nothing to learn; {differ}"
        )
    if not same:
        return cut_reason("pairs", count, cut, rule)
    lo, hi = min(cut), max(cut)
    return (
        f"none of its {count} pairs trains anything: {same} have the chosen response equal to the rejected "
        f"one, {len(cut)} are {rule.too_long_words()} ({lo} to {hi} tokens) and "
        f"cut; {differ}, and raise {rule.setting} (to {rule.keeping(hi)}) or shorten them"
    )
