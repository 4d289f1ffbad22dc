"""Geometry3K scoring as verl 0.9.1 does it for ``hiyouga/geometry3k``
(``verl/utils/reward_score/geo3k.py``, which grades with the ``mathruler`` package).

``0.9 * accuracy + 0.1 * format``: accuracy is 1 when the content of the last ``\\boxed{...}``
(the text ``"None"`` when there is none) grades equal to the ground truth under MathRuler's
variant of the PRM800K grader (``prm800k.MATHRULER``); format is 1 when the whole response
is ``<think>...</think>`` then a ``\\boxed{...}``, anything around them allowed.
"""
from __future__ import annotations

import re

from megarl.reward.prm800k import MATHRULER, grade_answer

_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def extract_boxed_content(text: str) -> str:
    """The content of the last ``\\boxed{`` up to its closing brace, stripped; ``"None"``
    when there is no box or it never closes (MathRuler's convention)."""
    start = text.rfind("\\boxed{")
    if start == -1:
        return "None"
    content = text[start + len("\\boxed{"):]
    depth = 0
    for i, char in enumerate(content):
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
        if depth == -1:
            return content[:i].strip()
    return "None"


def format_reward(predict_str: str) -> float:
    return 1.0 if _FORMAT.fullmatch(predict_str) else 0.0


def acc_reward(predict_str: str, ground_truth: str, use_boxed: bool = True) -> float:
    answer = extract_boxed_content(predict_str) if use_boxed else predict_str
    return 1.0 if grade_answer(answer, ground_truth, MATHRULER) else 0.0


def compute_score(predict_str: str, ground_truth: str, use_boxed: bool = True,
                  format_score: float = 0.1) -> float:
    return ((1.0 - format_score) * acc_reward(predict_str, ground_truth, use_boxed)
            + format_score * format_reward(predict_str))
