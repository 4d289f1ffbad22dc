"""The last-digit task's reward: exact needs the stop token; a constant answer earns little."""
import pytest

from megarl.reward.last_digit import DATA_SOURCE, compute_score
from megarl.reward.registry import default_compute_score


def score(text, finish="stop", gt="9", n_tokens=None):
    info = {"finish_reason": finish}
    if n_tokens is not None:
        info["response_length"] = n_tokens
    return compute_score(DATA_SOURCE, text, gt, info)


def test_tiers():
    assert score("9") == 1.0 and score(" 9 ") == 1.0          # whitespace ignored
    assert score("9", finish="length") == 0.5                   # right, but cut at the cap
    assert score("99") == pytest.approx(0.4) and score("9777") == pytest.approx(0.2)  # runs on
    assert score("9abcdef", finish="length") == 0.1             # never below 0.1 once right
    assert score("8") == 0.0 and score("") == 0.0 and score("x9") == 0.0
    # no finish_reason (a bare string scored offline): the text alone decides
    assert compute_score(DATA_SOURCE, "9", 9) == 1.0


def test_with_the_token_count_tokens_after_the_digit_cost_what_they_show_or_not():
    # the trap of a character count: "9" and whitespace (or special tokens decoding to
    # nothing) to the cap earned the full 0.5, more than running on by a visible character
    assert score("9   ", finish="length", n_tokens=4) == pytest.approx(0.2)
    assert score("9", finish="length", n_tokens=4) == pytest.approx(0.2)
    assert score("9xyz", finish="length", n_tokens=4) == pytest.approx(0.2)
    # ending sooner with the stop token, anywhere, earns more (the stop token not counted)
    assert score("9x", n_tokens=3) == pytest.approx(0.4)
    assert score("9 ", n_tokens=3) == 1.0 and score("9", n_tokens=2) == 1.0  # exact
    assert score("8", n_tokens=2) == 0.0


def test_a_constant_answer_earns_a_tenth_of_the_right_start_credit():
    # answering "5" everywhere, with the stop token: exact on one prompt in ten, 0 elsewhere
    mean = sum(score("5", gt=str(g)) for g in range(10)) / 10
    assert mean == 0.1


def test_dispatched_by_data_source():
    assert default_compute_score(DATA_SOURCE, "3", "3", {"finish_reason": "stop"}) == 1.0
    assert default_compute_score(DATA_SOURCE, "3", "3", {"finish_reason": "length"}) == 0.5
