"""GSM8K scoring as verl 0.9.1 does it (``verl/utils/reward_score/gsm8k.py``, after ReFT).

The answer is the number after the last ``#### `` in the response's final 300 characters
(strict, the default: it checks the format too), or the last number there (flexible). It
scores ``score`` when it equals ``ground_truth`` *as a string*, so the ground truth must be
the bare answer (``"72"``, as verl's GSM8K preprocessing stores it), not the worked solution,
and not an int; ``format_score`` when it differs, and 0 when there is no answer. A wider net
(a ``\\boxed{}``, a ground truth ending in ``#### 72``) is ``math_exact``'s, under megarl's own
names.
"""
from __future__ import annotations

import re
from typing import Optional

CLIP_CHARS = 300  # verl looks only at the tail: the answer ends a GSM8K solution
_STRICT = re.compile(r"#### (-?[0-9.,]+)")
_FLEXIBLE = re.compile(r"(-?[0-9.,]+)")


def extract_answer(solution_str: str, method: str = "strict") -> Optional[str]:
    if method not in ("strict", "flexible"):
        raise ValueError(f"method must be 'strict' or 'flexible', not {method!r}")
    tail = solution_str[-CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(tail)
        return found[-1].replace(",", "").replace("$", "") if found else None
    found = _FLEXIBLE.findall(tail)
    if not found:
        return None
    # the last match that is more than a lone "."; verl falls back to the first when every
    # match is one (its loop leaves the last one it looked at)
    return next((n for n in reversed(found) if n not in ("", ".")), found[0])


def compute_score(solution_str: str, ground_truth, method: str = "strict",
                  format_score: float = 0.0, score: float = 1.0):
    """``score``, ``format_score`` or 0 (an int, as verl returns it)."""
    answer = extract_answer(solution_str, method)
    if answer is None:
        return 0
    return score if answer == ground_truth else format_score
