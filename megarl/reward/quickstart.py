"""The quickstart task's scorer: ``compute_score`` for data_source ``megarl/quickstart``.

The quickstart must show a reward that rises within a few dozen GRPO steps on a randomly
initialised 2-layer model, so the reward is shaped to be dense: a random policy earns small,
varied scores (GRPO needs spread within a group to have any signal), and every step towards
"a short number close to the answer" is paid a little more. Tiers, for ground truth ``g``:

- ``1.0``: the response, with surrounding whitespace removed, is exactly ``str(g)``.
- otherwise the sum of three partial credits, at most ``0.7`` (``"07"`` for 7) and at most
  ``0.6`` for the repeated right digit (``"7 7 7"``), so exact always wins:
  - ``0.3 × digit fraction``: digits among the response's non-whitespace characters;
  - ``0.1`` if the whole response is one integer (format: "answer with a number");
  - ``0.3 / (1 + |n − g|)`` for the first integer ``n`` in the response (closeness).

The response is cut at the first end-of-text marker, in case the caller decoded without
``skip_special_tokens``. Deliberately simple: no parsing of words ("seven") or expressions.
"""
from __future__ import annotations

import re

DATA_SOURCE = "megarl/quickstart"

# Markers of the tiny tokenizer (megarl.utils.tiny_model) that end a response.
_END_MARKERS = ("<|im_end|>", "<|endoftext|>")
_INT = re.compile(r"-?\d+")

W_DIGITS = 0.3
W_FORMAT = 0.1
W_CLOSE = 0.3


def _cut(text: str) -> str:
    for marker in _END_MARKERS:
        i = text.find(marker)
        if i >= 0:
            text = text[:i]
    return text.strip()


def compute_score(data_source: str, solution_str: str, ground_truth, extra_info=None) -> float:
    """Score one response (verl's signature); ``ground_truth`` is the answer as int or str."""
    del data_source, extra_info  # one task, one rule
    answer = int(str(ground_truth).strip())
    text = _cut(solution_str)
    if text == str(answer):
        return 1.0
    chars = [c for c in text if not c.isspace()]
    if not chars:
        return 0.0
    score = W_DIGITS * sum(c.isdigit() for c in chars) / len(chars)
    if _INT.fullmatch(text):
        score += W_FORMAT
    m = _INT.search(text)
    if m:
        # Huge digit strings are far from the answer anyway; cap to avoid giant ints.
        n = int(m.group()[:12])
        score += W_CLOSE / (1.0 + abs(n - answer))
    return score
