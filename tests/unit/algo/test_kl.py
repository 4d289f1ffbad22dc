"""Per-token KL estimators against hand-computed values."""
import math

import pytest
import torch

from megarl.algo.kl import KL_KINDS, kl_penalty

LN2 = math.log(2)
# token 0: pi = 0.5, pi_ref = 0.25 -> d = logp - ref = +ln 2
# token 1: pi = 0.25, pi_ref = 0.5 -> d = -ln 2
LOGP = torch.log(torch.tensor([[0.5, 0.25]]))
REF = torch.log(torch.tensor([[0.25, 0.5]]))


@pytest.mark.parametrize("kind,want", [
    ("k1", [LN2, -LN2]),
    ("k2", [0.5 * LN2 ** 2, 0.5 * LN2 ** 2]),           # 0.240227 each
    ("k3", [0.5 - 1 + LN2, 2 - 1 - LN2]),               # exp(-d) - 1 + d: 0.193147, 0.306853
    ("abs", [LN2, LN2]),
])
def test_each_kind(kind, want):
    torch.testing.assert_close(kl_penalty(LOGP, REF, kind), torch.tensor([want]))


@pytest.mark.parametrize("alias,name", [("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")])
def test_aliases(alias, name):
    torch.testing.assert_close(kl_penalty(LOGP, REF, alias), kl_penalty(LOGP, REF, name))


def test_identical_policies_give_zero():
    for kind in KL_KINDS:
        assert torch.count_nonzero(kl_penalty(LOGP, LOGP, kind)) == 0


def test_low_var_kl_is_clamped():
    # d = -30: exp(30) would be 1e13; -d clamps to 20, exp(20) - 21 > 10, result clamps to 10.
    # d = +30: exp(-20) + 19 = 19 -> clamped to 10.
    out = kl_penalty(torch.tensor([0.0, 0.0]), torch.tensor([30.0, -30.0]), "low_var_kl")
    torch.testing.assert_close(out, torch.tensor([10.0, 10.0]))


def test_unknown_kind_raises():
    with pytest.raises(ValueError):
        kl_penalty(LOGP, REF, "k4")


# --- KL in the reward and the adaptive controller ----------------------------------------------
from megarl.algo.kl import adaptive_kl_coef, apply_kl_in_reward  # noqa: E402


def test_kl_in_reward_hand_computed():
    # k1 d = logp - ref: row 0 response tokens 1, 2 have d = +ln2, -ln2; row 1 token 0 d = 0.5;
    # row 2 has no response. Position values outside the mask are junk (d = 9).
    logp = torch.tensor([[9.0, LN2, 0.0], [0.5, 9.0, 9.0], [9.0, 9.0, 9.0]])
    ref = torch.tensor([[0.0, 0.0, LN2], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[0, 1, 1], [1, 0, 0], [0, 0, 0]])
    out, m = apply_kl_in_reward(torch.tensor([1.0, 2.0, 3.0]), logp, ref, mask, "k1", 0.1)
    want = torch.tensor([[0.0, -0.1 * LN2, 1.0 + 0.1 * LN2], [2.0 - 0.05, 0, 0], [0, 0, 0]])
    torch.testing.assert_close(out, want)
    # per-sample token-mean KL: row 0 (ln2 - ln2) / 2 = 0, row 1 0.5; rows with tokens only
    assert m == {"reward/kl_penalty": pytest.approx(0.25), "reward/kl_coef": 0.1}
    # token-level rewards in: the penalty is subtracted on top of them
    dense = torch.ones(3, 3)
    out, _ = apply_kl_in_reward(dense, logp, ref, mask, "k1", 0.1)
    torch.testing.assert_close(out, mask * (1 - 0.1 * (logp - ref)))


def test_kl_in_reward_all_masked_no_nan():
    out, m = apply_kl_in_reward(torch.ones(2), torch.zeros(2, 3), torch.ones(2, 3),
                                torch.zeros(2, 3), "low_var_kl", 0.1)
    assert torch.count_nonzero(out) == 0 and m["reward/kl_penalty"] == 0.0


def test_adaptive_kl_coef():
    # error clip(0.15 / 0.1 - 1, +-0.2) = 0.2 -> 0.1 * (1 + 0.2 * 100 / 1000) = 0.102
    assert adaptive_kl_coef(0.1, 0.15, 0.1, 100, 1000) == pytest.approx(0.102)
    # error -0.1 -> 0.1 * (1 - 0.1 * 0.1) = 0.099
    assert adaptive_kl_coef(0.1, 0.09, 0.1, 100, 1000) == pytest.approx(0.099)
    with pytest.raises(ValueError):
        adaptive_kl_coef(0.1, 0.1, 0.0, 1, 1)
