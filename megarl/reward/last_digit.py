"""The learnable task's scorer: ``compute_score`` for data_source ``megarl/last_digit``.

The second quickstart (``configs/quickstart_solve.yaml``) must show a randomly initialised
2-layer model *solving* its task, exact answers included, so the reward pays only for what
depends on the prompt. A credit a constant answer could earn (any digit, any short number)
is what the arithmetic quickstart's policy collapses onto; here a constant answer earns a
tenth of the partial credit and nothing more. Tiers, for the answer digit ``g``:

- ``1.0``: the response is exactly ``g`` (whitespace ignored) **and** ended with a stop token,
  so the policy must learn to stop right after its answer;
- ``0.5 - 0.1`` per token after ``g`` (at least ``0.1``): the response starts with ``g`` but
  goes on, or is ``g`` and was cut at the length cap; of two right starts the one that goes on
  less wins, which steers the policy towards ending, and then to the stop token;
- ``0.0``: anything else.

How the response ended comes from ``extra_info["finish_reason"]`` (``"stop"`` or
``"length"``) and how many tokens it has from ``extra_info["response_length"]`` (the stop
token included), which the reward pool adds for every response it scores. The tokens after
``g`` are counted, not the characters, because a count of what the text shows had a trap:
whitespace, which the text ignores, and the special tokens that decode to nothing, were free
(``"9"`` and three spaces, cut at the cap, earned the full 0.5, more than ``"9x"`` and the stop
token), so a run could settle on the digit and whitespace to the cap, sampling the stop token
ever more rarely; one of two runs at lr 5e-4 sat at exactly 0.5 from step 300 to 400.
Counted in tokens, every way of running on to the cap earns the same, and ending sooner by a
stop token, anywhere, earns more. The answer is one token (a digit) in the tokenizers this
task runs with. Called without these keys (offline scoring of a bare string), the text alone
decides, each character after ``g`` counted.
"""
from __future__ import annotations

DATA_SOURCE = "megarl/last_digit"

W_RIGHT_START = 0.5
W_PER_EXTRA = 0.1
W_RIGHT_START_MIN = 0.1


def compute_score(data_source: str, solution_str: str, ground_truth, extra_info=None) -> float:
    """Score one response (verl's signature); ``ground_truth`` is the answer digit."""
    del data_source  # one task, one rule
    answer = str(ground_truth).strip()
    text = "".join(solution_str.split())
    info = extra_info or {}
    stopped = info.get("finish_reason", "stop") == "stop"
    if text == answer and stopped:
        return 1.0
    if answer and text.startswith(answer):
        n_tokens = info.get("response_length")
        if n_tokens is None:
            extra = len(text) - len(answer)
        else:  # the tokens after the one-token answer, the stop token not counted
            extra = max(0, int(n_tokens) - 1 - int(stopped))
        return max(W_RIGHT_START_MIN, W_RIGHT_START - W_PER_EXTRA * extra)
    return 0.0
