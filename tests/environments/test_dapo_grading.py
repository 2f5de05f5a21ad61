"""DAPO's grader (NeMo-RL's ``math_verify_impl: dapo_math_verify``), against the cases NeMo-RL's verifier states.

Each expected value is read off NeMo-RL's ``nemo_rl/environments/dapo_math_verifier.py`` at the fixtures' commit
(7ea279ab; adapted there from verl's ``math_dapo.py``): its comments' TeX shorthand table (``\\fracab`` →
``\\frac{a}{b}`` ...), the 300-character window ("the longest answer in MATH-500 has 159 characters"), the
``Answer:`` pattern, the substitution and removal lists, the ``1,000`` rule, and NeMo-RL's test of the
extracted answer (tests/unit/environments/test_math_environment.py: a wrong parseable answer is recorded as
'137'). When this file was written the same cases, and 20,000 random strings over the grader's alphabet, gave
identical (score, answer) pairs from NeMo-RL's module and this one.
"""

from __future__ import annotations

import pytest

from rlcore.environments.dapo_grading import extract, grade, normalize
from rlcore.environments.math_env import MathConfig, MathEnvironment

#: (completion, ground truth, score, recorded answer)
CASES = [
    ("So the answer is\nAnswer: 42", "42", 1.0, "42"),
    ("Answer: 137", "42", 0.0, "137"),  # NeMo-RL's test: the wrong answer is recorded as is
    ("answer : $\\boxed{7}$", "7", 1.0, "7"),  # (?i)Answer\s*:  and the boxed wrapper removed
    ("Answer: 3\nAnswer: 4", "4", 1.0, "4"),  # the last answer line counts
    ("Answer: x = 5", "5", 1.0, "5"),  # what follows the last '='
    ("Answer: 1,000 dollars", "1000", 1.0, "1000"),  # units dropped, then 1,000 → 1000
    ("Answer: 90^\\circ", "90", 1.0, "90"),
    ("Answer: 10 \\text{ cm}", "10", 1.0, "10"),
    ("Answer: $5$ units.", "5", 1.0, "5"),
    ("Answer: a banana", "banana", 1.0, "banana"),  # the article 'a ' dropped
    ("Answer: \\textbf{12}", "12", 1.0, "12"),
    ("Answer: \\overline{AB}", "AB", 1.0, "AB"),
    ("Answer: 0.5", "1/2", 0.0, "0.5"),  # no symbolic comparison: string equality after normalising
    ("Answer: \\text{(A)}", "A", 0.0, "(A)"),
    ("no answer here", "3", 0.0, "[INVALID]"),
    ("x" * 400 + "Answer: 9", "9", 1.0, "9"),  # within the last 300 characters
    ("Answer: 9" + "x" * 400, "9", 0.0, "[INVALID]"),  # before them: not read
]


@pytest.mark.parametrize(("completion", "truth", "score", "answer"), CASES)
def test_the_score_and_answer_are_nemo_rl_s(completion, truth, score, answer):
    assert grade(completion, truth) == (score, answer)


@pytest.mark.parametrize(
    ("shorthand", "normal"),
    [  # the table in NeMo-RL's normalize_final_answer comments
        ("\\fracab", "\\frac{a}{b}"),
        ("\\frac{abc}{bef}", "\\frac{abc}{bef}"),
        ("\\fracabc", "\\frac{a}{b}c"),
        ("\\sqrta", "\\sqrt{a}"),
        ("\\sqrtab", "\\sqrt{a}b"),
    ],
)
def test_tex_shorthand_normalises_as_nemo_rl_s_comments_say(shorthand, normal):
    assert normalize(shorthand) == normal
    assert extract(f"Answer: {shorthand}") == normal


def test_the_math_environment_grades_with_it_when_asked():
    env = MathEnvironment(MathConfig(verifier="dapo"))
    logs = [[{"role": "assistant", "content": text}] for text in ("Answer: 1/2", "\\boxed{0.5}", "Answer: 0.5")]
    result = env.step(logs, [{"ground_truth": "1/2"}] * 3)
    assert [float(r) for r in result.rewards] == [1.0, 0.0, 0.0]  # a boxed answer without 'Answer:' scores 0
    assert result.answers == ["1/2", "[INVALID]", "0.5"]
