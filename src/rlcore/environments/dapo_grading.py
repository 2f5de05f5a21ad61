"""DAPO's math grader (NeMo-RL's ``env.math.math_verify_impl: dapo_math_verify``), rewritten for rlcore.

The rules are those of NeMo-RL's ``nemo_rl/environments/dapo_math_verifier.py`` (from verl's ``math_dapo.py``,
the Minerva answer normalisation): only the last 300 characters of the completion count; its answer is the text
after the last ``Answer:`` on a line; answer and ground truth are normalised the same way and must then be equal
as strings. There is no symbolic comparison: ``1/2`` and ``0.5`` differ, as they do in NeMo-RL.
"""

from __future__ import annotations

import re

#: How much of the end of a completion is read (NeMo-RL: "the longest answer in MATH-500 has 159 characters").
TAIL_CHARS = 300
#: The answer line DAPO's prompt asks for ("Answer: $Answer"); the last one counts.
ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
#: What a completion without an answer line is graded as (never equal to a normalised ground truth).
NO_ANSWER = "[INVALID]"

#: Replacements applied in order, then the words and marks dropped (units, ``\text{}`` leftovers, degrees, ...).
REPLACED = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
DROPPED = (
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    '"',
    "\\dots",
)
#: Regular rewrites, in order: the first ``$...$`` of a line, the content of text/bold/overline/boxed wrappers,
#: and TeX shorthand (``\fracab`` → ``\frac{a}{b}``, ``\sqrta`` → ``\sqrt{a}``).
REWRITES = (
    (re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), "$\\3$"),
    (re.compile(r"(\\text\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\textbf\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\overline\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\boxed\{)(.*)(\})"), "\\2"),
    (re.compile(r"(frac)([^{])(.)"), "frac{\\2}{\\3}"),
    (re.compile(r"(sqrt)([^{])"), "sqrt{\\2}"),
)


def normalize(answer: str) -> str:
    """The Minerva normal form of a final answer: what follows its last '=', units and TeX wrappers removed."""
    text = answer.split("=")[-1]
    for old, new in REPLACED:
        text = text.replace(old, new)
    for word in DROPPED:
        text = text.replace(word, "")
    for pattern, replacement in REWRITES:
        text = pattern.sub(replacement, text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():  # 1,000 → 1000
        text = text.replace(",", "")
    return text.strip()


def extract(completion: str) -> str:
    """The normalised answer of ``completion``: its last ``Answer:`` line within the last 300 characters."""
    found = ANSWER_LINE.findall(completion[-TAIL_CHARS:])
    return normalize(found[-1] if found else NO_ANSWER)


def grade(completion: str, ground_truth: str) -> tuple[float, str]:
    """``(1.0 or 0.0, the normalised answer)``: 1.0 when the answer equals the normalised ground truth."""
    answer = extract(completion)
    return float(answer == normalize(ground_truth)), answer


__all__ = ["grade", "extract", "normalize"]
