"""DAPO's math scoring as verl 0.9.1 does it for ``math_dapo``, ``math``,
``math_dapo_reasoning`` and every source starting with ``aime``
(``verl/utils/reward_score/math_dapo.py``): ``{"score": 1.0 or -1.0, "acc": bool, "pred": str}``.

Only the response's last 300 characters count. The answer is what follows the last
``Answer:`` (any case, to the end of the line), normalised as Minerva does
(``normalize_final_answer``: the part after the last ``=``, units and filler words removed,
``\\text{}``/``\\boxed{}`` unwrapped, ``\\fracab`` -> ``\\frac{a}{b}``, ``1,000`` -> ``1000``), and
compared with the ground truth normalised the same way. Without an ``Answer:`` line, the last
``\\boxed{...}`` in the final 100 characters is compared *unnormalised* with the raw ground
truth. With neither, ``pred`` is ``"[INVALID]"`` and the score -1. A wrong answer scores -1,
not 0: DAPO penalises it. Not done: verl's ``strict_box_verify`` / ``pause_tokens_index``
options are kept as parameters but the data-source dispatch never sets them.
"""
from __future__ import annotations

import re
from typing import Optional

from .math_exact import closing_brace

INVALID = "[INVALID]"
ANSWER_PATTERN = r"(?i)Answer\s*:\s*([^\n]+)"

# Minerva's normalisation tables (Lewkowycz et al. 2022, appendix), applied in this order.
SUBSTITUTIONS = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""),
    ("mbox", "text"), (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)
REMOVED_EXPRESSIONS = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units",
    "\\ldots", "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm",
    "pounds", "meters", "meals", "edges", "students", "childrentickets", "multiples",
    "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}",
    "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
)
_UNWRAP = [re.compile(p) for p in (r"(\\text\{)(.*?)(\})", r"(\\textbf\{)(.*?)(\})",
                                   r"(\\overline\{)(.*?)(\})", r"(\\boxed\{)(.*)(\})")]


def normalize_final_answer(answer: str) -> str:
    answer = answer.split("=")[-1]
    for before, after in SUBSTITUTIONS:
        answer = answer.replace(before, after)
    for expr in REMOVED_EXPRESSIONS:
        answer = answer.replace(expr, "")
    # keep only the first $...$ span of each line, with its dollars
    answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", r"$\3$", answer)
    for pattern in _UNWRAP:
        answer = pattern.sub(r"\2", answer)
    # shorthand TeX: \fracab -> \frac{a}{b}, \sqrta -> \sqrt{a}
    answer = re.sub(r"(frac)([^{])(.)", r"frac{\2}{\3}", answer)
    answer = re.sub(r"(sqrt)([^{])", r"sqrt{\2}", answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def last_boxed_only_string(text: str) -> Optional[str]:
    """The last ``\\boxed{...}`` with balanced braces, or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    end = closing_brace(text, start)
    return None if end is None else text[start:end + 1]


def _minerva(solution: str, ground_truth: str) -> tuple[bool, str]:
    found = re.findall(ANSWER_PATTERN, solution)
    pred = normalize_final_answer(found[-1] if found else INVALID)
    return pred == normalize_final_answer(ground_truth), pred


def _strict_box(solution: str, ground_truth: str,
                pause_tokens_index: Optional[list[int]] = None) -> tuple[bool, Optional[str]]:
    if pause_tokens_index is not None:
        if len(pause_tokens_index) != 4:
            raise ValueError("pause_tokens_index must have 4 entries")
        solution = solution[pause_tokens_index[-1] - 100:]
    else:
        solution = solution[-100:]
    boxed = last_boxed_only_string(solution)
    pred = boxed[len("\\boxed{"):-1] if boxed is not None else None
    return pred == ground_truth, pred


def verify(solution: str, ground_truth: str, strict_box_verify: bool = False,
           pause_tokens_index: Optional[list[int]] = None) -> tuple[bool, Optional[str]]:
    """(correct, prediction): Minerva's ``Answer:`` first, the last ``\\boxed{}`` otherwise."""
    if strict_box_verify:
        return _strict_box(solution, ground_truth, pause_tokens_index)
    correct, pred = _minerva(solution, ground_truth)
    if pred != INVALID:
        return correct, pred
    box_correct, box_pred = _strict_box(solution, ground_truth, pause_tokens_index)
    if box_pred is not None:
        return box_correct, box_pred
    return correct, pred


def compute_score(solution_str: str, ground_truth: str, strict_box_verify: bool = False,
                  pause_tokens_index: Optional[list[int]] = None) -> dict:
    """``{"score": 1.0 | -1.0, "acc": bool, "pred": str}``, as verl returns it."""
    correct, pred = verify(solution_str[-300:], ground_truth, strict_box_verify,
                           pause_tokens_index)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
