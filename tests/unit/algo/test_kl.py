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
