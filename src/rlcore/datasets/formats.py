"""Row formats (``data.<split>.format``): how a hub dataset's own columns become the rows rlcore reads.

A format is a function of one row, applied when the row is drawn (the dataset stays memory-mapped; nothing is
rewritten at start-up). Each does what NeMo-RL's dataset class of that name does to the row
(``nemo_rl/data/datasets``, main 7ea279a), so a converted NeMo-RL config trains on the same messages:

- ``squad``: the passage as the system message, the question as the user's, the first answer as the assistant's
  (``messages``);
- ``gsm8k``: ``question`` / ``answer``, the answer cut to what follows its ``####``;
- ``helpsteer3``: the ``context`` (a string becomes one user message) and the two responses ranked by
  ``overall_preference`` (negative: response1 preferred; 0: both completions are response1, as NeMo-RL does) as
  ``completions``;
- ``tulu3_preference``: the ``chosen`` conversation without its last message as the ``context``, the last
  messages of ``chosen`` and ``rejected`` as ranked ``completions``;
- ``clevr_cogent``: ``problem`` and ``image`` as they are, the ``solution`` cut to the text of its
  ``<answer>`` tags (all of it, stripped, without them);
- ``geometry3k``: ``problem`` without its ``<image>`` marker, the first of ``images`` only, ``answer``.

OpenAssistant's trees (one tree, many conversations) are not a row format: :mod:`rlcore.datasets.oasst`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from rlcore.datasets.files import DataError

Row = dict[str, Any]


def squad(row: Row) -> Row:
    answers = row["answers"]["text"]
    if not answers:
        raise ValueError("'answers.text' is empty")
    return {
        "messages": [
            {"role": "system", "content": row["context"]},
            {"role": "user", "content": row["question"]},
            {"role": "assistant", "content": answers[0]},
        ]
    }


def gsm8k(row: Row) -> Row:
    answer = row["answer"]
    return {"question": row["question"], "answer": answer.split("####")[1].strip() if "####" in answer else None}


def _ranked(chosen: str, rejected: str) -> list[Row]:
    return [
        {"rank": rank, "completion": [{"role": "assistant", "content": text}]}
        for rank, text in enumerate((chosen, rejected))
    ]


def helpsteer3(row: Row) -> Row:
    first, second, preference = row["response1"], row["response2"], row["overall_preference"]
    chosen, rejected = (second, first) if preference > 0 else (first, second if preference < 0 else first)
    context = row["context"]
    if isinstance(context, str):
        context = [{"role": "user", "content": context}]
    return {"context": list(context), "completions": _ranked(chosen, rejected)}


def tulu3_preference(row: Row) -> Row:
    chosen, rejected = row["chosen"], row["rejected"]
    if chosen[:-1] != rejected[:-1]:
        raise ValueError("'chosen' and 'rejected' differ before their last message")
    if chosen[-1]["role"] != "assistant" or rejected[-1]["role"] != "assistant":
        raise ValueError("the last message of 'chosen' or 'rejected' is not the assistant's")
    return {"context": list(chosen[:-1]), "completions": _ranked(chosen[-1]["content"], rejected[-1]["content"])}


def clevr_cogent(row: Row) -> Row:
    import re

    solution = str(row["solution"])
    tagged = re.search(r"<answer>(.*?)</answer>", solution, re.DOTALL)
    return {
        "problem": row["problem"],
        "image": row["image"],
        "solution": (tagged.group(1) if tagged else solution).strip(),
    }


def geometry3k(row: Row) -> Row:
    images = row["images"]
    first = images[:1] if isinstance(images, list) else [images]
    return {"problem": str(row["problem"]).replace("<image>", ""), "images": first, "answer": row["answer"]}


#: The row formats, by the name ``data.<split>.format`` gives.
FORMATS: dict[str, Callable[[Row], Row]] = {
    "squad": squad,
    "gsm8k": gsm8k,
    "helpsteer3": helpsteer3,
    "tulu3_preference": tulu3_preference,
    "clevr_cogent": clevr_cogent,
    "geometry3k": geometry3k,
}


class FormattedRows(Sequence[Row]):
    """``rows`` with a format applied to each row as it is read (``where``: the dataset, for errors)."""

    def __init__(self, rows: Sequence[Row], name: str, where: str) -> None:
        self.rows, self.name, self.where, self.fn = rows, name, where, FORMATS[name]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        try:
            return self.fn(dict(self.rows[i]))
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            what = f"no column {exc}" if isinstance(exc, KeyError) else str(exc)
            raise DataError(
                f"{self.where}: row {i + 1}: not a {self.name} row ({what}); the format expects the "
                f"columns of the dataset it is named after (docs/datasets.md)"
            ) from None
