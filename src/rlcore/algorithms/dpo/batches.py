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
is cut and masked as a whole.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlcore.algorithms.sft.batches import encode_conversation, padded_batch
from rlcore.datasets.files import DataError

if TYPE_CHECKING:
    from rlcore.data import BatchedDataDict
    from rlcore.datasets import Sample

Messages = list[dict[str, str]]


def _response(value: Any, where: str, key: str) -> Messages:
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    if isinstance(value, list) and value and all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                 and m.get("role") for m in value):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise DataError(f"{where}: '{key}' must be a text or a list of {{role, content}} messages")


def preference_pair(sample: "Sample", where: str) -> tuple[Messages, Messages, Messages]:
    """``(prompt, chosen, rejected)`` message logs of a DPO sample (see the module docstring)."""
    row = sample.metadata
    at = f"{where}: row {sample.idx + 1}"
    if "chosen" in row and "rejected" in row:
        return list(sample.messages), _response(row["chosen"], at, "chosen"), _response(row["rejected"], at,
                                                                                          "rejected")
    completions = row.get("completions")
    if isinstance(completions, list) and len(completions) >= 2:
        try:
            ranked = sorted(completions, key=lambda c: c["rank"])
            return (list(sample.messages), _response(ranked[0]["completion"], at, "completions"),
                    _response(ranked[1]["completion"], at, "completions"))
        except (KeyError, TypeError):
            raise DataError(f"{at}: each of 'completions' needs a 'rank' and a 'completion'") from None
    raise DataError(f"{at}: a DPO sample needs 'chosen' and 'rejected' responses, or 'completions' (at least two, "
                    "ranked); the row has " + ", ".join(map(str, row)))


def dpo_batch(samples: list["Sample"], tokenizer: Any, cfg: Any, size: int | None = None) -> "BatchedDataDict":
    """``2 * size`` rows (``size`` pairs, default ``len(samples)``; the extra pairs masked fillers): right-padded
    ``input_ids``, ``input_lengths``, ``token_mask`` (the response), ``sample_mask``; ``group_size`` 2."""
    from rlcore.run.prompts import pad_id

    limit, dpo = cfg.policy.max_total_sequence_length, cfg.dpo
    rows, keep = [], []
    for sample in samples:
        prompt, *responses = preference_pair(sample, "data.train")
        pair = [encode_conversation(tokenizer, prompt + response, dpo, cfg.policy.tokenizer.chat_template_kwargs,
                                    trained=[False] * len(prompt) + [True] * len(response))
                for response in responses]
        fits = all(len(ids) <= limit for ids, _ in pair)
        rows += [(ids[:limit], mask[:limit]) for ids, mask in pair]
        keep += [fits, fits]
    size = size or len(samples)
    rows += rows[-2:] * (size - len(samples))  # filler pairs, masked out
    keep += [False, False] * (size - len(samples))
    batch = padded_batch(rows, keep, pad_id(tokenizer))
    batch.group_size = 2
    return batch
