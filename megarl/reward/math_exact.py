"""A simple exact-match scorer for math-style answers: 1.0 or 0.0. It scores megarl's own,
lenient names (``gsm8k``, and any other source containing ``math``/``gsm8k`` that verl does
not name); verl's names (``openai/gsm8k``, the MATH sets, ``math``, ...) get verl's scorers.

The answer is the content of the last ``\\boxed{...}`` in the response or, without one, the
last number in it (GSM8K's ``#### 42`` ends in a number too). Answers are compared as numbers
when both parse as numbers (so ``1,000``, ``1000.0`` and ``$1000`` all equal ``1000``), else as
strings with spaces and ``$`` removed. Deliberately simple: no symbolic equivalence
(``\\frac{1}{2}`` vs ``0.5``); plug a stronger verifier in through ``reward.reward_fn``.
"""
from __future__ import annotations

import re
from typing import Optional

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def closing_brace(text: str, start: int) -> Optional[int]:
    """The index of the ``}`` that closes the first ``{`` at or after `start`, or None when
    the braces never balance (the scorers' ``\\boxed{...}`` extraction)."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    return None


def last_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    end = closing_brace(text, start)
    return None if end is None else text[start + len("\\boxed{"):end]


def extract_answer(text: str) -> Optional[str]:
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    nums = _NUMBER.findall(text)
    return nums[-1] if nums else None


def _normalize(ans: str) -> str:
    return ans.replace("$", "").replace(" ", "").replace("\\!", "").strip().rstrip(".")


def _as_number(ans: str) -> Optional[float]:
    try:
        return float(ans.replace(",", ""))
    except ValueError:
        return None


def is_equiv(pred: str, truth: str) -> bool:
    p, t = _normalize(pred), _normalize(truth)
    pn, tn = _as_number(p), _as_number(t)
    if pn is not None and tn is not None:
        return abs(pn - tn) <= 1e-6 * max(1.0, abs(tn))
    return p == t


def compute_score(data_source: str, solution_str: str, ground_truth, extra_info=None) -> float:
    """1.0 when the extracted answer equals the ground truth (verl's signature), else 0.0."""
    del data_source, extra_info
    pred = extract_answer(solution_str)
    if pred is None:
        return 0.0
    truth = str(ground_truth)
    # A GSM8K-style ground truth may itself be a worked solution ending in "#### 42".
    if "####" in truth:
        truth = truth.rsplit("####", 1)[1]
    return 1.0 if is_equiv(pred, truth) else 0.0
