"""Writes the chat dataset of the sft_tiny example (src/rlcore/examples/data/chat_sft.jsonl).

Short conversations in the shape SFT data takes (``messages``: a system prompt, a user turn, the assistant's
answer; one in four has a second user/assistant exchange): string tasks a tiny byte-level model can learn in a
few minutes on a CPU — reverse a word, spell it in capitals, count its letters. The words are drawn from a fixed
alphabet with a fixed seed, so the file is the same every time. The example holds a tenth of the rows out as
validation (``data.split_validation_size``): the validation loss falls because the model learns the tasks, not
the rows.

    python scripts/make_chat_data.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "src" / "rlcore" / "examples" / "data"
SYSTEM = "Answer with the result only."
TASKS = {
    "reverse": lambda w: w[::-1],
    "upper": str.upper,
    "count": lambda w: str(len(w)),
}


def exchange(rng: random.Random) -> tuple[str, str]:
    word = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(2, 6)))
    task = rng.choice(sorted(TASKS))
    return f"{task} {word}", TASKS[task](word)


def main() -> None:
    rng = random.Random(0)
    rows = []
    for i in range(400):
        messages = [{"role": "system", "content": SYSTEM}]
        for _ in range(2 if i % 4 == 0 else 1):
            question, answer = exchange(rng)
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        rows.append({"id": f"chat-{i}", "messages": messages})
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "chat_sft.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"{len(rows)} conversations in {OUT / 'chat_sft.jsonl'}")


if __name__ == "__main__":
    main()
