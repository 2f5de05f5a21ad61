"""The math grader: answer extraction, the built-in comparison rules, and the math_verify path when installed."""

from __future__ import annotations

import signal
import threading

import pytest

from rlcore.environments import math_grading as mg


def _importable(name: str) -> bool:
    try:
        __import__(name)
    except ImportError:
        return False
    return True


needs_sympy = pytest.mark.skipif(not _importable("sympy"), reason="the symbolic rules need sympy")

# ---------------------------------------------------------------------------------------------- extraction


@pytest.mark.parametrize(
    ("completion", "answer"),
    [
        ("So the answer is \\boxed{42}.", "42"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("first \\boxed{1}, then \\boxed{\\sqrt{\\frac{3}{4}}}", "\\sqrt{\\frac{3}{4}}"),
        ("\\fbox{7}", "7"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("\\boxed{3} and then \\boxed{4", "3"),  # the unfinished box is not an answer
        ("\\boxed 7 is it", "7"),
        ("We get 3 apples and then 5.", "5"),
        ("x = -3", "-3"),
        ("5-3", "3"),  # a minus between numbers is not a sign
        ("total: 1,234 dollars", "1,234"),
        ("pi is about 3.14.", "3.14"),
        ("a ratio of 3/4", "3/4"),
        ("half is $\\frac{1}{2}$ here", "\\frac{1}{2}"),
        ("so .5 of it", ".5"),
        ("no digits here", None),
        ("", None),
        ("\\boxed{}", None),
    ],
)
def test_extract_answer(completion, answer):
    assert mg.extract_answer(completion) == answer


# ---------------------------------------------------------------------------------------------- built-in rules

SAME = [
    ("42", "42"),
    ("0.5", "1/2"),
    ("\\frac12", "0.5"),
    ("\\dfrac{1}{2}", "1/2"),
    ("\\tfrac{1}{2}", "\\frac{1}{2}"),
    ("-\\frac{1}{2}", "-0.5"),
    ("\\frac{-3}{4}", "-0.75"),
    ("-7", "-7.0"),
    ("1,000", "1000"),
    ("1{,}000", "1000"),
    ("50\\%", "50"),
    ("50%", "0.5"),
    ("$12$", "12"),
    ("\\$12", "12"),
    ("\\text{5}", "5"),
    ("5\\text{ cm}", "5"),
    ("12 dollars", "12"),
    ("90^\\circ", "90"),
    ("\\left(3\\right)", "(3)"),
    ("x = 5", "5"),
    ("7.", "7"),
    ("\\text{(B)}", "B"),
    ("\\text{Yes}", "yes"),
    ("\\boxed{8}", "8"),
    pytest.param("\\frac{1}{\\sqrt{2}}", "\\sqrt{2}/2", marks=needs_sympy),
    pytest.param("\\dfrac{\\sqrt{3}}{2}", "\\frac{\\sqrt3}{2}", marks=needs_sympy),
    pytest.param("2\\pi", "\\pi*2", marks=needs_sympy),
    pytest.param("\\pi r^2", "r^{2}\\pi", marks=needs_sympy),
    pytest.param("\\sqrt[3]{8}", "2", marks=needs_sympy),
    pytest.param("2x+1", "1+2x", marks=needs_sympy),
    pytest.param("(x+1)^2", "x^2+2x+1", marks=needs_sympy),
    pytest.param("2^{10}", "1024", marks=needs_sympy),
]

DIFFERENT = [
    ("12", "1.2"),
    ("0.33", "1/3"),
    ("2", "22"),
    ("-2", "2"),
    ("1,2", "12"),
    ("50\\%", "5"),
    ("5 or more", "5"),
    ("\\sqrt{2}", "1.414"),
    ("x+1", "x+2"),
    ("x", "y"),
    ("A", "B"),
    ("E", "e"),
    ("\\frac{1}{0}", "1"),
    ("", "0"),
    ("1", ""),
]


@pytest.mark.parametrize(("given", "truth"), SAME)
def test_builtin_same(given, truth):
    assert mg._builtin_match(given, truth)
    assert mg._builtin_match(truth, given)


@pytest.mark.parametrize(("given", "truth"), DIFFERENT)
def test_builtin_different(given, truth):
    assert not mg._builtin_match(given, truth)


@pytest.mark.parametrize(
    "given",
    [
        "__import__('os').system('echo hacked')",
        "x.__class__",
        "S(1)",
        "lambda: 1",
    ],
)
def test_builtin_never_evaluates_code(given):
    assert not mg._builtin_match(given, "1")


def test_builtin_without_sympy_keeps_numbers_only(monkeypatch):
    monkeypatch.setattr(mg, "_has_sympy", lambda: False)
    assert mg._builtin_match("\\dfrac{1}{2}", "0.5")
    assert mg._builtin_match("1,000", "1000")
    assert not mg._builtin_match("\\frac{1}{\\sqrt{2}}", "\\sqrt{2}/2")


# ---------------------------------------------------------------------------------------------- grade

GRADED = [
    ("The answer is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),
    ("... so we get $\\boxed{1,000}$", "1000", 1.0),
    ("Therefore 17 cookies remain.", "17", 1.0),
    ("It is -4.", "-4", 1.0),
    ("\\boxed{50\\%}", "50", 1.0),
    pytest.param("\\boxed{\\dfrac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1.0, marks=needs_sympy),
    ("\\boxed{1.2}", "12", 0.0),
    ("\\boxed{0.33}", "1/3", 0.0),
    ("\\boxed{22}", "2", 0.0),
    ("I am not sure.", "3", 0.0),
    ("", "3", 0.0),
]

PATHOLOGICAL = [
    ("\\boxed{9^{9^{9^{9}}}}", "1"),
    ("\\boxed{2^{100000000}}", "1"),
    ("\\boxed{(10^{6})!}", "1"),
    ("9" * 10_000, "1"),
    ("\\boxed{" * 5_000, "1"),
    ("{" * 10_000 + "\\boxed{2}", "1"),
    ("(" * 150 + "2" + ")" * 150, "1"),
    ("^(" * 5_000, "1"),
    ("\\boxed{9^9^9}", "1"),
    ("\\boxed{(9^{9999})^{9999}}", "1"),
    ("\\boxed{\\binom{10^{9}}{10^{8}}}", "1"),
    ("\\boxed{" + "\\sqrt{" * 300 + "2" + "}" * 301, "1"),
    ("\\boxed{" + "(x+1)" * 600 + "}", "1"),
]


@pytest.mark.parametrize(("completion", "truth", "reward"), GRADED)
def test_grade_builtin(completion, truth, reward):
    assert mg.grade(completion, truth, builtin=True) == reward


@pytest.mark.parametrize(("completion", "truth"), PATHOLOGICAL)
def test_pathological_inputs_return_zero(completion, truth):
    # Nothing is asserted about time: the suite's timeout catches a hang.
    assert mg.grade(completion, truth, builtin=True) == 0.0
    assert mg.grade(completion, truth) == 0.0


def test_builtin_is_used_without_math_verify(monkeypatch):
    monkeypatch.setattr(mg, "_has_math_verify", lambda: False)
    assert mg.grader_name() == "builtin"
    assert mg.grade("\\boxed{\\frac{2}{4}}", "0.5") == 1.0
    assert mg.grade("\\boxed{3}", "0.5") == 0.0


def test_the_module_imports_neither_sympy_nor_math_verify():
    import subprocess
    import sys

    code = (
        "import sys; import rlcore.environments.math_grading as m; m.extract_answer('\\\\boxed{1}'); "
        "assert 'sympy' not in sys.modules and 'math_verify' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------------------------- math_verify


@pytest.mark.parametrize(("completion", "truth", "reward"), GRADED)
def test_grade_math_verify(completion, truth, reward):
    pytest.importorskip("math_verify")
    assert mg.grader_name() == "math_verify"
    assert mg.grade(completion, truth) == reward


def test_math_verify_off_the_main_thread():
    """Its signal-based timeouts would raise 'signal only works in main thread': they must be off there."""
    pytest.importorskip("math_verify")
    results, errors = [], []

    def work():
        try:
            results.extend([mg.grade("\\boxed{\\frac{1}{2}}", "0.5"), mg.grade("\\boxed{3}", "0.5")])
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert not errors
    assert results == [1.0, 0.0]


def test_math_verify_keeps_a_pending_alarm():
    """signal.alarm() would cancel someone else's timer (pytest-timeout's, for one): it must be left alone."""
    pytest.importorskip("math_verify")
    if not hasattr(signal, "setitimer") or signal.getitimer(signal.ITIMER_REAL) != (0.0, 0.0):
        pytest.skip("needs ITIMER_REAL, unused")
    previous = signal.signal(signal.SIGALRM, lambda *_: None)
    signal.setitimer(signal.ITIMER_REAL, 600)
    try:
        assert mg.grade("\\boxed{\\frac{1}{2}}", "0.5") == 1.0
        assert signal.getitimer(signal.ITIMER_REAL)[0] > 0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
