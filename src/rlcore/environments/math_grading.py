"""Grading a completion's final answer against a math ground truth (reward 1.0 or 0.0).

Two graders, picked by :func:`grade`:

* ``math_verify`` -- Hugging Face's math-verify (``pip install 'rlcore[math]'``), used when it imports. It
  finds the answer itself (last ``\\boxed{}``, "final answer is ...", last LaTeX or plain expression) and
  compares with sympy: sets, intervals, equations, matrices, and decimals rounded to 6 places
  (so ``0.333333`` matches ``1/3``). Its timeouts use ``SIGALRM``; they are switched on only in the main
  thread with no other alarm pending (it would cancel that alarm), and off otherwise. Either way inputs that
  could make sympy run for ever or for seconds (exponent towers, huge exponents or factorials, answers or
  ground truths over 1000 characters) go to the built-in grader instead.
* ``builtin`` -- the rules below, used otherwise (or with ``grade(..., builtin=True)``). The answer is the
  last ``\\boxed{}``/``\\fbox{}``, else the last number; the comparison normalises LaTeX, compares the text,
  then exact rational values (decimals are exact: ``0.33`` is not ``1/3``), then -- when sympy imports --
  simple expressions numerically at 30 digits (``\\sqrt{2}/2`` vs ``1/\\sqrt{2}``, ``2x+1`` vs ``1+2x``).
  It never calls ``simplify`` and skips sympy for long or explosive inputs, so it cannot hang.

Neither sympy nor math_verify is imported until a grade needs it.
"""

from __future__ import annotations

import cmath
import functools
import re
import threading
from fractions import Fraction

__all__ = ["answers_match", "extract_answer", "grade", "grader_name"]

_MAX_SYMPY_CHARS = 200  # longer answers are compared as text and numbers only
_MAX_NUMBER_CHARS = 400  # Python refuses to parse integers of more than 4300 digits anyway
_MV_TIMEOUT_S = 3  # math_verify's per-parse and per-comparison limit, when signals can be used
_MAX_MV_CHARS = 1000  # longer answers take math_verify seconds to parse and compare
_REL_TOL = 1e-12

# ---------------------------------------------------------------------------------------------- extraction

_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{|\\boxed\s+([^\s${}]+)")
_FRAC_NUM = r"-?\\[dt]?frac(?:\{-?\d+\}\{-?\d+\}|\d\d)"
_PLAIN_NUM = r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:/\d+(?:\.\d+)?)?|(?<![\w.])-?\.\d+"
_NUMBER = re.compile(f"{_FRAC_NUM}|{_PLAIN_NUM}")


def _brace_matches(text: str) -> dict[int, int]:
    """Position of each ``{`` -> position of its ``}``, in one pass (escaped ``\\{``, ``\\}`` don't count)."""
    matches, stack = {}, []
    for i, ch in enumerate(text):
        if ch in "{}" and i and text[i - 1] == "\\":
            continue
        if ch == "{":
            stack.append(i)
        elif ch == "}" and stack:
            matches[stack.pop()] = i
    return matches


def extract_answer(completion: str) -> str | None:
    """The final answer a completion gives: the content of its last complete ``\\boxed{...}`` (or ``\\fbox``),
    else its last number (``-12``, ``1,234``, ``3.5``, ``3/4``, ``\\frac{3}{4}``); None when there is none."""
    boxes = list(_BOX.finditer(completion))
    if boxes:
        braces = _brace_matches(completion)
        for box in reversed(boxes):
            if box.group(1) is not None:  # \boxed 5
                return box.group(1)
            open_at = box.end() - 1
            if open_at in braces:
                content = completion[open_at + 1 : braces[open_at]].strip()
                if content:
                    return content
    numbers = list(_NUMBER.finditer(completion))
    return numbers[-1].group(0) if numbers else None


# ---------------------------------------------------------------------------------------------- normalising

_WRAPPERS = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_DROP = re.compile(r"\\left|\\right|\\displaystyle|\\[,;:! ]|~|\^\s*\{?\\circ\}?|\\circ|\\degree|°|\\\$|\$")
_UNITS = re.compile(r"(-?[\d.,/]*\d%?)\s+(?!(?:or|and|to)\b)[a-zA-Z]{2,}\.?(?:\s+[a-zA-Z]+\.?)*")


def _unbox(text: str) -> str:
    """``\\boxed{x}`` -> ``x`` when the whole text is one box (ground truths sometimes come boxed)."""
    match = re.fullmatch(r"\\(?:boxed|fbox)\s*\{(.*)\}", text, flags=re.DOTALL)
    if match and _brace_matches(text).get(text.index("{")) == len(text) - 1:
        return match.group(1)
    return text


def _normalize(answer: str) -> str:
    s = _unbox(answer.strip().strip("$").strip())
    s = re.sub(r"^\\\(|\\\)$|^\\\[|\\\]$", "", s)
    for _ in range(3):  # nested wrappers: \text{\textbf{5}}
        s = _WRAPPERS.sub(lambda m: " " + m.group(1), s)
    s = _DROP.sub("", s)
    s = s.replace("\\%", "%").replace("{,}", "").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.strip().rstrip(".").strip()
    units = _UNITS.fullmatch(s)
    if units:  # "5 cm", "12 dollars": the number alone
        s = units.group(1)
    if s.count("=") == 1:  # "x = 5" -> "5"
        s = re.sub(r"^[a-zA-Z]\s*=", "", s)
    s = re.sub(r"^\((\w)\)$", r"\1", s.strip())  # "(A)" -> "A"
    s = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s)  # 1,000 -> 1000
    s = re.sub(r"(\\[a-zA-Z]+)\s+(?=[a-zA-Z])", lambda m: m.group(1) + "\x00", s)  # keep "\pi r" apart
    return re.sub(r"\s+", "", s).replace("\x00", " ")


# ---------------------------------------------------------------------------------------------- numbers

_DECIMAL = r"-?(?:\d+(?:\.\d*)?|\.\d+)"


def _to_fraction(s: str) -> tuple[Fraction, bool] | None:
    """``(value, is_percent)`` of a plain number, ``a/b`` or ``\\frac{a}{b}``; None for anything else."""
    percent = s.endswith("%")
    s = s.removesuffix("%")
    if len(s) > _MAX_NUMBER_CHARS:
        return None
    sign = 1
    frac = re.fullmatch(r"(-?)\\frac(?:\{(" + _DECIMAL + r")\}\{(" + _DECIMAL + r")\}|(\d)(\d))", s)
    if frac:  # \frac{a}{b}, \frac12, -\frac{a}{b}
        sign = -1 if frac.group(1) else 1
        parts = [frac.group(2) or frac.group(4), frac.group(3) or frac.group(5)]
    else:
        parts = s.split("/")
        if len(parts) > 2 or not all(re.fullmatch(_DECIMAL, p) for p in parts):
            return None
    try:
        value = Fraction(parts[0]) / (Fraction(parts[1]) if len(parts) == 2 else 1)
    except (ValueError, ZeroDivisionError):
        return None
    return sign * value, percent


def _numbers_equal(a: tuple[Fraction, bool], b: tuple[Fraction, bool]) -> bool:
    """Exact; a percent may stand for its number (50% = 50) or its fraction (50% = 0.5)."""
    options_a = {a[0], a[0] / 100} if a[1] else {a[0]}
    options_b = {b[0], b[0] / 100} if b[1] else {b[0]}
    return bool(options_a & options_b) if a[1] != b[1] else a[0] == b[0]


# ---------------------------------------------------------------------------------------------- sympy

_COMMANDS = {
    "pi": " pi ",
    "infty": " oo ",
    "cdot": "*",
    "times": "*",
    "div": "/",
    "ln": " log ",
    "log": " log ",
    "exp": " exp ",
    "sin": " sin ",
    "cos": " cos ",
    "tan": " tan ",
}
_FUNCTIONS = {"sqrt", "pi", "oo", "log", "exp", "sin", "cos", "tan"}


def _group(s: str, i: int) -> tuple[str, int]:
    """The argument at ``s[i]``: a ``{...}`` group's content or one character; and the index after it."""
    while i < len(s) and s[i] == " ":
        i += 1
    if i >= len(s):
        raise ValueError("missing argument")
    if s[i] != "{":
        return s[i], i + 1
    depth = 0
    for j in range(i, len(s)):
        depth += {"{": 1, "}": -1}.get(s[j], 0)
        if depth == 0:
            return s[i + 1 : j], j + 1
    raise ValueError("unbalanced braces")


def _to_plain(s: str) -> str:
    """A small LaTeX subset as a sympy-parsable string; ValueError for anything outside it."""
    out, i = [], 0
    while i < len(s):
        command = re.match(r"\\([a-zA-Z]+)", s[i:])
        if not command:
            out.append({"{": "(", "}": ")", "[": "(", "]": ")", "^": "**"}.get(s[i], s[i]))
            i += 1
            continue
        name, i = command.group(1), i + command.end()
        if name == "frac":
            num, i = _group(s, i)
            den, i = _group(s, i)
            out.append(f"(({_to_plain(num)})/({_to_plain(den)}))")
        elif name == "sqrt":
            degree = None
            if s[i : i + 1] == "[":
                end = s.index("]", i)
                degree, i = s[i + 1 : end], end + 1
            arg, i = _group(s, i)
            out.append(f"(({_to_plain(arg)})**(1/({_to_plain(degree)})))" if degree else f"sqrt({_to_plain(arg)})")
        elif name in _COMMANDS:
            out.append(_COMMANDS[name])
        else:
            raise ValueError(f"unsupported command \\{name}")
    return "".join(out)


def _leading_operand(text: str) -> str | None:
    """The bracketed group (``{..}``, ``(..)``) or the token that ``text`` starts with; None if unbalanced."""
    if text[:1] not in ("{", "("):
        return re.match(r"-?[\w.]*", text).group(0)
    closer, depth = "}" if text[0] == "{" else ")", 0
    for j, ch in enumerate(text):
        depth += (ch == text[0]) - (ch == closer)
        if depth == 0:
            return text[: j + 1]
    return None


def _explosive(text: str) -> bool:
    """Whether evaluating ``text`` could take for ever: an exponent holding an exponent or a number of 5+
    digits (``9^{9^9}``, ``9^9^9``, ``2**100000``), a power of a power with a 3-digit exponent
    (``(9^{999})^{999}``), the factorial of something that is not a small literal, a binomial of big numbers,
    or a number of 300+ digits (sympy's handling of those is slow). A heuristic: it errs towards True."""
    if re.search(r"(?:[)}]|\d{4,})\s*!|\d{300}|(?:binom|choose)[^$]{0,40}?(?:\d{5}|\^)", text):
        return True
    for op in re.finditer(r"\^|\*\*", text):
        rest = text[op.end() : op.end() + _MAX_SYMPY_CHARS].lstrip()  # an exponent longer than that is suspect
        exponent = _leading_operand(rest)
        if (
            exponent is None
            or re.search(r"\^|\*\*|\d{5,}", exponent)
            or rest[len(exponent) :].lstrip().startswith(("^", "**"))
        ):
            return True
        base = _trailing_group(text[max(0, op.start() - _MAX_SYMPY_CHARS) : op.start()].rstrip())
        if re.search(r"\d{3}", exponent) and (base is None or re.search(r"\^|\*\*", base)):
            return True
    return False


def _trailing_group(text: str) -> str | None:
    """The bracketed group ``text`` ends with ('' when it ends otherwise); None if unbalanced."""
    if text[-1:] not in ("}", ")"):
        return ""
    opener, depth = "{" if text[-1] == "}" else "(", 0
    for j in range(len(text) - 1, -1, -1):
        depth += (text[j] == text[-1]) - (text[j] == opener)
        if depth == 0:
            return text[j:]
    return None


@functools.lru_cache(maxsize=1)
def _has_sympy() -> bool:
    try:
        import sympy  # noqa: F401
    except ImportError:
        return False
    return True


def _sympy_expr(s: str):
    """The sympy expression for a normalised answer, or None. The string is checked against a whitelist
    before ``parse_expr`` (which evaluates Python): numbers, operators, brackets, single letters, a few names."""
    from sympy import Symbol, cos, exp, log, oo, pi, sin, sqrt, tan
    from sympy.parsing.sympy_parser import convert_xor, implicit_multiplication, parse_expr, standard_transformations

    if len(s) > _MAX_SYMPY_CHARS or _explosive(s):
        return None
    try:
        plain = _to_plain(s)
    except ValueError:
        return None
    if (
        re.search(r"[^0-9A-Za-z.+\-*/() ]|\.(?!\d)", plain)
        or _explosive(plain)
        or any(len(w) > 1 and w not in _FUNCTIONS for w in re.findall(r"[A-Za-z]+", plain))
    ):
        return None
    names = {c: Symbol(c) for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"}
    names.update(sqrt=sqrt, pi=pi, oo=oo, log=log, exp=exp, sin=sin, cos=cos, tan=tan)
    try:
        return parse_expr(
            plain,
            local_dict=names,
            evaluate=False,
            transformations=standard_transformations + (implicit_multiplication, convert_xor),
        )
    except Exception:  # noqa: BLE001 - SyntaxError, TokenError, RecursionError...: not an expression we handle
        return None


def _close(a, b) -> bool | None:
    """Whether two evaluated sympy numbers agree to ``_REL_TOL``; None when either is not a finite number."""
    try:
        x, y = complex(a), complex(b)
    except (TypeError, ValueError):
        return None
    if not (cmath.isfinite(x) and cmath.isfinite(y)):
        return None
    return abs(x - y) <= _REL_TOL * max(1.0, abs(x), abs(y))


def _sympy_equal(given: str, truth: str) -> bool:
    a, b = _sympy_expr(given), _sympy_expr(truth)
    if a is None or b is None:
        return False
    try:
        symbols = a.free_symbols | b.free_symbols
        if a.free_symbols != b.free_symbols:
            return False
        if not symbols:
            return bool(_close(a.evalf(30), b.evalf(30)))
        # Same function of the same variables: agree at a few fixed points (no simplify).
        agreed = 0
        for k in range(5):
            point = {sym: 0.31 + 0.7 * k + 0.13 * n for n, sym in enumerate(sorted(symbols, key=str))}
            same = _close(a.evalf(30, subs=point), b.evalf(30, subs=point))
            if same is False:
                return False
            agreed += same is True
        return agreed >= 2
    except Exception:  # noqa: BLE001 - an evaluation error means "not shown equal"
        return False


# ---------------------------------------------------------------------------------------------- public API


def answers_match(given: str, ground_truth: str) -> bool:
    """Whether two answers are the same math, by the built-in rules (see the module docstring)."""
    a, b = _normalize(given), _normalize(ground_truth)
    if not a or not b:
        return False
    if a == b or (len(a) > 1 and a.isalpha() and b.isalpha() and a.casefold() == b.casefold()):  # Yes, yes
        return True
    num_a, num_b = _to_fraction(a), _to_fraction(b)
    if num_a is not None and num_b is not None:
        return _numbers_equal(num_a, num_b)
    return _has_sympy() and _sympy_equal(a.removesuffix("%"), b.removesuffix("%"))


_builtin_match = answers_match  # for tests: the built-in comparison whatever grader is installed


def _builtin_grade(completion: str, ground_truth: str) -> float:
    answer = extract_answer(completion)
    return float(answer is not None and answers_match(answer, ground_truth))


@functools.lru_cache(maxsize=1)
def _has_math_verify() -> bool:
    try:
        import math_verify  # noqa: F401
    except Exception:  # noqa: BLE001 - ImportError, or a broken install (an antlr4 runtime it cannot use)
        return False
    return True


def _signal_timeouts_usable() -> bool:
    """math_verify's timeouts call ``signal.alarm``: main thread only, and it would cancel a pending alarm
    (pytest-timeout's, for one), so only when there is none."""
    import signal

    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "getitimer"):
        return False
    return signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def _math_verify_grade(completion: str, ground_truth: str) -> float:
    from math_verify import parse, verify

    answer = extract_answer(completion) or ""
    if _explosive(completion) or _explosive(ground_truth) or max(len(answer), len(ground_truth)) > _MAX_MV_CHARS:
        return _builtin_grade(completion, ground_truth)
    limit = _MV_TIMEOUT_S if _signal_timeouts_usable() else None
    gold = parse("\\boxed{" + ground_truth.strip().strip("$") + "}", parsing_timeout=limit)
    if not gold:  # a ground truth math_verify cannot read
        return _builtin_grade(completion, ground_truth)
    predicted = parse(completion, parsing_timeout=limit)
    return float(bool(predicted) and verify(gold, predicted, timeout_seconds=limit))


def grader_name() -> str:
    """``"math_verify"`` when Hugging Face's math-verify imports, else ``"builtin"``."""
    return "math_verify" if _has_math_verify() else "builtin"


def grade(completion: str, ground_truth: str, *, builtin: bool = False) -> float:
    """1.0 when the completion's final answer equals ``ground_truth`` as math, else 0.0; with math_verify when
    it is installed unless ``builtin`` is set."""
    if not builtin and _has_math_verify():
        return _math_verify_grade(completion, ground_truth)
    return _builtin_grade(completion, ground_truth)
