"""The quickstart reward's shaping: exact is 1.0, partial credit is dense and below it."""
from __future__ import annotations

import random
import statistics

import pytest

from megarl.reward.quickstart import compute_score


def score(text, gt="7"):
    return compute_score("megarl/quickstart", text, gt)


@pytest.mark.parametrize("text", ["7", " 7", "7\n", "7<|im_end|>junk", "7<|endoftext|>"])
def test_exact_answer_is_one(text):
    assert score(text) == 1.0
    assert score(text, 7) == 1.0


def test_partial_credit_orders_responses():
    assert score("") == score("   ") == score("hello") == 0.0
    # closer numbers beat farther ones; a bare number beats one in junk; all below exact.
    ladder = [score("abc"), score("x9x"), score("99"), score("8"), score("7")]
    assert ladder == sorted(ladder) and len(set(ladder)) == len(ladder)
    assert score("8") == pytest.approx(0.3 + 0.1 + 0.15)
    assert max(score(t) for t in ["6", "8", "7 7", "77", "-7", "7.0", "007x"]) == pytest.approx(0.6)
    assert score("07") == pytest.approx(0.7)  # the most a wrong answer can earn
    assert score("12345678901234567890") < 0.45  # huge numbers: no overflow, low closeness


def test_random_strings_get_a_spread():
    rng = random.Random(0)
    alphabet = "abcdefghij klmnop+?!.0123456789"
    scores = [score("".join(rng.choices(alphabet, k=rng.randint(1, 8))), str(rng.randint(0, 18)))
              for _ in range(2000)]
    mean, std = statistics.mean(scores), statistics.pstdev(scores)
    assert 0.02 < mean < 0.4 and std > 0.05
    assert sum(s == 0.0 for s in scores) > 100 and len(set(scores)) > 50
    assert max(scores) <= 1.0 and min(scores) >= 0.0
