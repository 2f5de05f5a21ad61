"""Writes the preference dataset of the dpo_tiny example (src/rlcore/examples/data/preference_dpo.jsonl).

The string tasks of the sft_tiny example (reverse / capitalise / count a word), each prompt with a right answer
(``chosen``) and a plausible wrong one (``rejected``: the word as it was, half-capitalised, or a count off by
one) — NeMo-RL's binary preference shape (``prompt``, ``chosen``, ``rejected``). Fixed seed, so the file is the
same every time. The example holds a tenth of the rows out: its validation accuracy rises because the model
learns what a right answer looks like, not the rows.

    python scripts/make_preference_data.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "src" / "rlcore" / "examples" / "data"


def pair(rng: random.Random) -> tuple[str, str, str]:
    word = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(3, 6)))
    task = rng.choice(["count", "reverse", "upper"])
    if task == "reverse":
        return f"reverse {word}", word[::-1], word
    if task == "upper":
        half = len(word) // 2
        return f"upper {word}", word.upper(), word[:half].upper() + word[half:]
    return f"count {word}", str(len(word)), str(len(word) + rng.choice([-1, 1]))


def main() -> None:
    rng = random.Random(0)
    rows = []
    while len(rows) < 400:
        prompt, chosen, rejected = pair(rng)
        if chosen != rejected:  # a palindrome reversed is itself: no preference
            rows.append({"id": f"pref-{len(rows)}", "prompt": prompt, "chosen": chosen, "rejected": rejected})
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "preference_dpo.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"{len(rows)} preference pairs in {OUT / 'preference_dpo.jsonl'}")


if __name__ == "__main__":
    main()
