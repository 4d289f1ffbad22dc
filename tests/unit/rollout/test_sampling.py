"""Sampling: truncation keeps the right tokens, log-probs are the untruncated tempered ones
(with stop tokens banned before min_new_tokens: renormalised over the rest, as stock SGLang)."""
import math

import torch

from megarl.rollout.sampling import RowSampling, sample

LOGITS = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))


def rows(n=1, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, seed=0):
    gens = []
    for i in range(n):
        g = torch.Generator()
        g.manual_seed(seed + i)
        gens.append(g)
    return RowSampling([temperature] * n, [top_p] * n, [top_k] * n, [min_p] * n, gens, "cpu")


def drawn(n=400, **kw):
    s = rows(n, **kw)
    tokens, _ = sample(LOGITS.expand(n, -1), s)
    return set(tokens.tolist()), tokens


def test_top_k_top_p_min_p_keep_the_right_tokens():
    assert drawn(top_k=2)[0] == {0, 1}
    # p=0.8: 0.5 < 0.8, 0.5+0.3 reaches it -> {0, 1}; p=0.81 needs the third token.
    assert drawn(top_p=0.8)[0] == {0, 1}
    assert drawn(top_p=0.81)[0] == {0, 1, 2}
    assert drawn(min_p=0.5)[0] == {0, 1}  # 0.15 < 0.5 * 0.5
    assert drawn()[0] == {0, 1, 2, 3}


def test_frequencies_follow_the_distribution():
    _, tokens = drawn(n=4000)
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03)


def test_logprob_is_untruncated_tempered_distribution():
    s = rows(8, temperature=0.7, top_k=2)
    tokens, lps = sample(LOGITS.expand(8, -1), s)
    ref = torch.log_softmax(LOGITS[0] / 0.7, dim=-1)
    assert torch.allclose(lps, ref[tokens])


def test_greedy_reports_temperature_one_logprob():
    tokens, lps = sample(LOGITS, rows(temperature=0.0))
    assert tokens.tolist() == [0] and math.isclose(lps.item(), math.log(0.5), rel_tol=1e-5)


def test_seeded_rows_are_independent_of_batch_neighbours():
    alone, _ = sample(LOGITS, rows(1, seed=11))
    s = rows(3, seed=10)  # row 1 has seed 11
    together, _ = sample(LOGITS.expand(3, -1), s)
    assert together[1] == alone[0]


def test_banned_tokens_are_not_drawn_and_logprobs_are_of_the_distribution_drawn_from():
    # stock SGLang's min-new-tokens penalty sets the stop ids' logits to -inf before its
    # log-softmax: the reported log-prob is the drawn token's among the allowed ones
    banned = torch.tensor([[True, False, False, False]])
    tokens, lps = sample(LOGITS, rows(temperature=0.0), banned)
    assert tokens.tolist() == [1] and math.isclose(lps.item(), math.log(0.3 / 0.5), rel_tol=1e-5)
    s = rows(64, temperature=0.7)
    tokens, lps = sample(LOGITS.expand(64, -1), s, banned.expand(64, -1))
    assert 0 not in tokens.tolist() and len(set(tokens.tolist())) == 3
    allowed = torch.log_softmax(LOGITS[0, 1:] / 0.7, dim=-1)
    assert torch.allclose(lps, allowed[tokens - 1])
    # rows without a ban are untouched by their neighbours' (one row banned, one not)
    both = torch.tensor([[True, False, False, False], [False] * 4])
    tokens, lps = sample(LOGITS.expand(2, -1), rows(2, temperature=0.0), both)
    assert tokens.tolist() == [1, 0] and math.isclose(lps[1].item(), math.log(0.5), rel_tol=1e-5)
