"""The learnable task's scorer: ``compute_score`` for data_source ``megarl/last_digit``.

The second quickstart (``configs/quickstart_solve.yaml``) must show a randomly initialised
2-layer model *solving* its task, exact answers included, so the reward pays only for what
depends on the prompt. A credit a constant answer could earn (any digit, any short number)
is what the arithmetic quickstart's policy collapses onto; here a constant answer earns a
tenth of the partial credit and nothing more. Tiers, for the answer digit ``g``:

- ``1.0``: the response is exactly ``g`` (whitespace ignored) **and** ended with a stop token,
  so the policy must learn to stop right after its answer;
- ``0.5 - 0.1`` per character after ``g`` (at least ``0.1``): the response starts with ``g``
  but goes on, or is ``g`` and was cut at the length cap; of two right starts the one that
  goes on less wins, which steers the policy towards ending, and then to the stop token;
- ``0.0``: anything else.

How the response ended comes from ``extra_info["finish_reason"]`` (``"stop"`` or
``"length"``), which the reward pool adds for every response it scores. Called without it
(offline scoring of a bare string), the text alone decides.
"""
from __future__ import annotations

DATA_SOURCE = "megarl/last_digit"

W_RIGHT_START = 0.5
W_PER_EXTRA_CHAR = 0.1
W_RIGHT_START_MIN = 0.1


def compute_score(data_source: str, solution_str: str, ground_truth, extra_info=None) -> float:
    """Score one response (verl's signature); ``ground_truth`` is the answer digit."""
    del data_source  # one task, one rule
    answer = str(ground_truth).strip()
    text = "".join(solution_str.split())
    stopped = (extra_info or {}).get("finish_reason", "stop") == "stop"
    if text == answer and stopped:
        return 1.0
    if answer and text.startswith(answer):
        extra = len(text) - len(answer)
        return max(W_RIGHT_START_MIN, W_RIGHT_START - W_PER_EXTRA_CHAR * extra)
    return 0.0
