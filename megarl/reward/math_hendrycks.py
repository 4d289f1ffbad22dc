"""MATH scoring as verl 0.9.1 does it for ``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval``
and ``HuggingFaceH4/MATH-500`` (``verl/utils/reward_score/math_reward.py``): Hendrycks' MATH
string normalisation (as in lm-evaluation-harness), 1.0 or 0.0.

The answer is the last ``\\boxed{...}`` of the response (or ``\\boxed 5`` up to a ``$``; a last
``\\fbox{}`` is found but, as in verl, scores 0). It equals the ground truth when both
normalise to the same string (``strip_string``): ``\\dfrac``/``\\tfrac`` -> ``\\frac``, no
``\\left``/``\\right``, no ``^\\circ``, ``\\$``, ``\\%``, units after ``\\text{ ``, ``x=`` prefixes
(at most two characters), spaces; ``\\sqrt2`` -> ``\\sqrt{2}``, ``\\frac12`` -> ``\\frac{1}{2}``,
``0.5`` -> ``\\frac{1}{2}``, ``3/4`` -> ``\\frac{3}{4}``, a leading ``.5`` -> ``0.5``. No symbolic
equivalence: ``0.25`` is not ``\\frac{1}{4}``. ``strip_string`` is also the "mathd" step of the
PRM800K grader (``prm800k``), where its error cases matter, so they are kept: a second
``\\text{ ``, or ``\\sqrt``/``\\frac`` ending the string, raises as verl's does.
"""
from __future__ import annotations

import logging
from typing import Optional

from .math_exact import closing_brace

logger = logging.getLogger(__name__)


def last_boxed_only_string(text: str) -> Optional[str]:
    """The last ``\\boxed{...}`` (or ``\\fbox{...}``) of ``text`` with its braces balanced, or
    ``\\boxed `` plus what follows it up to a ``$``; None when there is none or it is open."""
    if "\\boxed " in text:
        return "\\boxed " + text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    end = closing_brace(text, start)
    return None if end is None else text[start:end + 1]


def remove_boxed(boxed: str) -> str:
    """The inside of ``\\boxed{...}`` / ``\\boxed ...``; AssertionError for anything else."""
    if "\\boxed " in boxed:
        assert boxed.startswith("\\boxed "), boxed
        return boxed[len("\\boxed "):]
    assert boxed.startswith("\\boxed{") and boxed.endswith("}"), boxed
    return boxed[len("\\boxed{"):-1]


def _fix_fracs(s: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{72}`` -> ``\\frac{1}{72}``; the input unchanged
    when a ``\\frac`` is followed by a single character; IndexError when one ends it."""
    head, *rest = s.split("\\frac")
    out = [head]
    for part in rest:
        if part[0] == "{":
            out.append("\\frac" + part)
            continue
        if len(part) < 2:
            return s
        a, b, tail = part[0], part[1], part[2:]
        out.append("\\frac{" + a + "}" + ("{" + b + "}" if b != "{" else "{") + tail)
    return "".join(out)


def _fix_a_slash_b(s: str) -> str:
    """``3/4`` -> ``\\frac{3}{4}`` when both sides are integers written canonically."""
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    return f"\\frac{{{a}}}{{{b}}}" if s == f"{a}/{b}" else s


def _remove_right_units(s: str) -> str:
    if "\\text{ " not in s:
        return s
    parts = s.split("\\text{ ")
    assert len(parts) == 2, s  # as verl: a second unit block is an error
    return parts[0]


def _fix_sqrt(s: str) -> str:
    """``\\sqrt3`` -> ``\\sqrt{3}`` (one character); IndexError when ``\\sqrt`` ends the string."""
    head, *rest = s.split("\\sqrt")
    return head + "".join("\\sqrt" + (p if p[0] == "{" else "{" + p[0] + "}" + p[1:])
                          for p in rest)


def strip_string(s: str, *, bare_percent: bool = False) -> str:
    """Hendrycks' MATH normalisation. ``bare_percent`` also drops a plain ``%`` (MathRuler's
    variant, used by geometry3k); verl's own drops only ``\\%`` (and ``\\\\%``)."""
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "")
    s = _remove_right_units(s)
    if bare_percent:
        s = s.replace("\\%", "").replace("%", "")
    else:
        s = s.replace("\\\\%", "").replace("\\%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "x=5", "k = 3"
        s = sides[1]
    s = _fix_sqrt(s)
    s = s.replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _fix_a_slash_b(s)


def is_equiv(a, b) -> bool:
    if a is None and b is None:
        return True
    if a is None or b is None:
        return False
    try:
        return strip_string(a) == strip_string(b)
    except Exception:  # noqa: BLE001 - as verl: a normalisation error compares the raw values
        return a == b


def compute_score(solution_str: str, ground_truth) -> float:
    """1.0 when the last boxed answer is equivalent to ``ground_truth``, else 0.0."""
    try:
        boxed = last_boxed_only_string(solution_str)
        if boxed is not None and is_equiv(remove_boxed(boxed), ground_truth):
            return 1.0
    except Exception as err:  # noqa: BLE001 - verl prints the error and scores 0
        logger.debug("MATH scorer: %s: %s", type(err).__name__, err)
    return 0.0
