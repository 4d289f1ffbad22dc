"""The PRM800K answer grader (OpenAI's ``prm800k/grading/grader.py``), in the two variants
verl 0.9.1's built-in scorers call: ``PRIME`` (verl's ``prime_math/__init__.py``, for the
``numina_*`` sets) and ``MATHRULER`` (the ``mathruler`` package 0.1.0's ``grader.py``, which
verl's ``geo3k.py`` imports).

``grade_answer(grader, given, ground_truth)`` is True when

1. both are equal after Hendrycks' MATH normalisation (``math_hendrycks.strip_string``), or
2. both are equal after the grader's own normalisation (``normalize``: ``\\text{}``, ``$``,
   ``%`` and units dropped, ``million`` -> ``*10^6``, an integer-valued float made an integer,
   LaTeX turned into plain text by ``latex_text.latex_to_text`` and ``√``/``π``/``∞``/``·``/``×``
   into sympy's spelling, lower case), or
3. element by element for tuples and intervals, sympy simplifies the difference to 0, except
   that two fractions ``a/b`` must match as written and an integer only matches an integer.
   Expressions with more than two distinct letters or with ``^{``/``^(`` or big exponents are
   not given to sympy.

The variants differ in small ways, each a field of ``Grader``. Deliberate difference: verl
bounds each sympy comparison of ``PRIME`` at 10 s in a forked process; here the bound is a
SIGALRM timer, set only on a process's main thread (the reward pool's workers) and when no
other timer is running; a sympy call stuck inside C code is then cut by the pool's
``reward.timeout_s`` instead.
"""
from __future__ import annotations

import contextlib
import dataclasses
import re
import signal
import threading
from typing import Optional

from megarl.reward.latex_text import latex_to_text
from megarl.reward.math_hendrycks import strip_string


@dataclasses.dataclass(frozen=True)
class Grader:
    bare_percent: bool          # the mathd step drops a plain "%" too (MathRuler)
    units: tuple[str, ...]      # unit words dropped by `normalize`, in this order
    drop_spaces_and_braces: bool  # `normalize` ends by removing " ", "{" and "}" (MathRuler)
    sympy_time_limit_s: Optional[float]


_UNITS = ("degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day",
          "week", "month", "year", "foot", "feet", "inch", "yard")
PRIME = Grader(bare_percent=False, units=_UNITS + ("liter",), drop_spaces_and_braces=False,
               sympy_time_limit_s=10.0)
MATHRULER = Grader(bare_percent=True, units=_UNITS, drop_spaces_and_braces=True,
                   sympy_time_limit_s=None)

_TEXT_WRAPPED = re.compile(r"^\\text\{(?P<text>.+?)\}$")
_PROPER_COMMA = re.compile(r"(\d)(,)(\d\d\d)($|\D)")
_MIXED_NUMBER = re.compile(r"([0-9]) +([0-9])")  # "7 3/4" -> "7+3/4"
_FRACTION = re.compile(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$")
_BAD_FOR_SYMPY = re.compile(r"\^[0-9]+\^|\^[0-9][0-9]+")  # towers, big exponents: sympy hangs
_TUPLE_CHARS = "()[]"
_UNICODE_TO_SYMPY = (("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*"),
                     ("×", "*"))


def normalize_mathd(answer: Optional[str], grader: Grader) -> Optional[str]:
    """PRM800K's ``math_normalize.normalize_answer``: an enclosing ``\\text{}`` removed, then
    Hendrycks' normalisation; the answer as it was when that raises."""
    if answer is None:
        return None
    answer = answer.strip()
    try:
        m = _TEXT_WRAPPED.search(answer)
        if m is not None:
            answer = m.group("text").strip()
        return strip_string(answer, bare_percent=grader.bare_percent)
    except Exception:  # noqa: BLE001 - as PRM800K
        return answer


def _is_float(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _is_int(x: float) -> bool:
    try:
        return abs(x - int(round(x))) <= 1e-7
    except Exception:  # noqa: BLE001 - inf, nan
        return False


def strip_proper_commas(expr: str) -> str:
    """``1,000,000`` -> ``1000000``, leaving tuple commas (``1,2``) alone."""
    while True:
        stripped = _PROPER_COMMA.sub(r"\1\3\4", expr)
        if stripped == expr:
            return stripped
        expr = stripped


def _str_is_int(text: str) -> bool:
    try:
        return _is_int(float(strip_proper_commas(text)))
    except Exception:  # noqa: BLE001
        return False


def _parse_latex(expr: str) -> str:
    expr = expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac")
    expr = expr.replace("\\frac", " \\frac")  # so that a mixed number 1\frac12 stays apart
    expr = latex_to_text(expr)
    for uni, spelled in _UNICODE_TO_SYMPY:
        expr = expr.replace(uni, spelled)
    return expr.strip()


def normalize(expr: Optional[str], grader: Grader) -> Optional[str]:
    """The grader's own normalisation (PRM800K's ``_normalize``)."""
    if expr is None:
        return None
    m = _TEXT_WRAPPED.search(expr)
    if m is not None:
        expr = m.group("text")
    for before, after in (("\\%", "%"), ("\\$", "$"), ("$", ""), ("%", ""), (" or ", " , "),
                          (" and ", " , "), ("million", "*10^6"), ("billion", "*10^9"),
                          ("trillion", "*10^12")):
        expr = expr.replace(before, after)
    for unit in grader.units:
        expr = re.sub(f"{unit}(es)?(s)? *(\\^[0-9]+)?", "", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if len(expr) > 0 and expr[0] == "{" and expr[-1] == "}":
        expr = expr[1:-1]
    expr = re.sub(r",\\! *", "", expr)
    if _is_float(expr) and _is_int(float(expr)):
        expr = str(int(round(float(expr))))
    if "\\" in expr:
        with contextlib.suppress(Exception):
            expr = _parse_latex(expr)
    expr = re.sub("- *", "-", expr)  # "- 3" -> "-3", mixed numbers with a sign
    expr = _MIXED_NUMBER.sub(r"\1+\2", expr)
    if grader.drop_spaces_and_braces:
        expr = expr.replace(" ", "").replace("{", "").replace("}", "")
    expr = expr.lower()
    if _str_is_int(expr):
        expr = str(int(float(expr.replace(",", ""))))
    return expr


def _sympy_allowed(expr: str) -> bool:
    letters = {c for c in expr.replace("sqrt", "").replace("frac", "") if c.isalpha()}
    if len(letters) > 2:  # unknown text, or a function of many variables
        return False
    if "^{" in expr or "^(" in expr:
        return False
    return _BAD_FOR_SYMPY.search(expr) is None


@contextlib.contextmanager
def _time_limit(seconds: Optional[float]):
    """Raise TimeoutError in the body after ``seconds`` (main thread, no other timer), else
    run it unbounded."""
    usable = (seconds is not None and hasattr(signal, "setitimer")
              and threading.current_thread() is threading.main_thread()
              and signal.getitimer(signal.ITIMER_REAL)[0] == 0)
    if not usable:
        yield
        return

    def on_alarm(signum, frame):
        raise TimeoutError(f"sympy comparison ran past {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def equal_under_sympy(ground_truth: str, given: str, grader: Grader) -> bool:
    """sympy simplifies ``(ground_truth)-(given)`` to 0 (implicit multiplication allowed)."""
    import sympy
    from sympy.parsing import sympy_parser

    expr = f"({ground_truth})-({given})"
    try:
        with _time_limit(grader.sympy_time_limit_s):
            if not _sympy_allowed(expr):
                return False
            transformations = (sympy_parser.standard_transformations
                               + (sympy_parser.implicit_multiplication_application,))
            diff = sympy_parser.parse_expr(expr.replace("^", "**"),
                                           transformations=transformations)
            return bool(sympy.simplify(diff) == 0)
    except Exception:  # noqa: BLE001 - unparsable, or too slow: not equal
        return False


def split_tuple(expr: str) -> list[str]:
    """The elements of a tuple or interval ``(a, b)``/``[a, b)``; ``[expr]`` otherwise."""
    expr = strip_proper_commas(expr)
    if not expr:
        return []
    if (len(expr) > 2 and expr[0] in _TUPLE_CHARS and expr[-1] in _TUPLE_CHARS
            and not any(ch in expr[1:-1] for ch in _TUPLE_CHARS)):
        return [elem.strip() for elem in expr[1:-1].split(",")]
    return [expr]


def grade_answer(given: Optional[str], ground_truth: str, grader: Grader = PRIME) -> bool:
    if given is None:
        return False
    if normalize_mathd(ground_truth, grader) == normalize_mathd(given, grader):
        return True
    truth_n, given_n = normalize(ground_truth, grader), normalize(given, grader)
    if truth_n is None:
        return False
    if truth_n == given_n:
        return True
    if not given_n:
        return False
    truth_elems, given_elems = split_tuple(truth_n), split_tuple(given_n)
    if len(truth_elems) > 1 and (truth_n[0] != given_n[0] or truth_n[-1] != given_n[-1]):
        return False  # (a, b) is not [a, b]
    if len(truth_elems) != len(given_elems):
        return False
    for truth_elem, given_elem in zip(truth_elems, given_elems):
        if _FRACTION.search(truth_elem) and _FRACTION.search(given_elem):
            equal = truth_elem == given_elem  # an unreduced fraction is not the answer
        elif _str_is_int(truth_elem) != _str_is_int(given_elem):
            equal = False  # an integer answer must be matched exactly
        else:
            equal = equal_under_sympy(truth_elem, given_elem, grader)
        if not equal:
            return False
    return True
