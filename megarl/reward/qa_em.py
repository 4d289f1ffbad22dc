"""Search-R1 question answering as verl 0.9.1 scores it for the ``searchR1_*`` sets
(``verl/utils/reward_score/search_r1_like_qa_em.py``): exact match, SQuAD-style.

The answer is the inside of the last ``<answer>...</answer>`` (newlines allowed, stripped).
``ground_truth`` is a dict whose ``"target"`` holds the accepted answers (a string or a
sequence of strings). Both sides are normalised: lower case, punctuation dropped, the articles
a/an/the dropped, runs of whitespace made one space. A match scores ``score`` (1), or a quarter
of it when the response holds more than ten ``<answer>`` or ``</answer>`` tags (spamming the
tag); no match scores ``format_score`` (0); no answer at all, 0. Left out: verl prints one
call in 64 at random (consuming the global ``random`` state) and, when it does, reads
``ground_truth["target"]`` even for a response without an answer.
"""
from __future__ import annotations

import re
import string
from typing import Optional

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)
SPAM_TAGS = 10


def normalize_answer(text: str) -> str:
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _targets(golden_answers):
    return [golden_answers] if isinstance(golden_answers, str) else golden_answers


def em_check(prediction: str, golden_answers) -> int:
    pred = normalize_answer(prediction)
    return int(any(normalize_answer(g) == pred for g in _targets(golden_answers)))


def subem_check(prediction: str, golden_answers) -> int:
    pred = normalize_answer(prediction)
    return int(any(normalize_answer(g) in pred for g in _targets(golden_answers)))


def extract_solution(solution_str: str) -> Optional[str]:
    matches = _ANSWER.findall(solution_str)
    return matches[-1].strip() if matches else None


def compute_score(solution_str: str, ground_truth, method: str = "strict",
                  format_score: float = 0.0, score: float = 1.0):
    """Exact match: ``score`` (an int 1 by default), ``score / 4`` for tag spam,
    ``format_score`` or 0."""
    del method  # verl's signature; unused there too
    answer = extract_solution(solution_str)
    if answer is None:
        return 0
    if not em_check(answer, ground_truth["target"]):
        return format_score
    if solution_str.count("<answer>") > SPAM_TAGS or solution_str.count("</answer>") > SPAM_TAGS:
        return score / 4
    return score


def compute_score_subem(solution_str: str, ground_truth, method: str = "strict",
                        format_score: float = 0.0, score: float = 1.0):
    """Substring match (verl's ``compute_score_subem``; not in its dispatch)."""
    del method
    answer = extract_solution(solution_str)
    if answer is None:
        return 0
    return score if subem_check(answer, ground_truth["target"]) else format_score
