"""PPO loss (clip, dual clip, decoupled TIS), aggregation modes and micro-batch shares."""
import math

import pytest
import torch

from megarl.algo.aggregate import aggregate, global_denom
from megarl.algo.losses import aggregate_entropy, ppo_policy_loss

LN = math.log


def _lp(ratios):
    """logp, old_logp with logp - old_logp = ln(ratio), old_logp = ln(0.1)."""
    old = torch.full((1, len(ratios)), LN(0.1))
    return old + torch.log(torch.tensor([ratios])), old


def test_clip_both_sides():
    # eps 0.2, per token: -A*r vs -A*clip(r, 0.8, 1.2), take the max
    #  r=1.5 A=+1: max(-1.5, -1.2) = -1.2 (clipped)   r=1.5 A=-1: max(1.5, 1.2) = 1.5
    #  r=0.5 A=+1: max(-0.5, -0.8) = -0.5             r=0.5 A=-1: max(0.5, 0.8) = 0.8 (clipped)
    # token-mean: (-1.2 + 1.5 - 0.5 + 0.8) / 4 = 0.15
    logp, old = _lp([1.5, 1.5, 0.5, 0.5])
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    loss, st = ppo_policy_loss(logp, old, adv, torch.ones(1, 4), 0.2, 0.2)
    torch.testing.assert_close(loss, torch.tensor(0.15))
    torch.testing.assert_close(st["pg_loss"], torch.tensor(0.15))
    torch.testing.assert_close(st["clip_frac"], torch.tensor(0.5))
    torch.testing.assert_close(st["ratio_mean"], torch.tensor(1.0))
    torch.testing.assert_close(st["ratio_max"], torch.tensor(1.5))
    # ppo_kl = mean(old - logp) = -(2 ln 1.5 + 2 ln 0.5) / 4 = 0.143841
    torch.testing.assert_close(st["ppo_kl"], torch.tensor(-(2 * LN(1.5) + 2 * LN(0.5)) / 4))
    assert "tis_weight_mean" not in st


def test_asymmetric_clip_higher():
    # clip_high 0.28: r=1.5 A=+1 -> -1.28; clip_low 0.1: r=0.5 A=-1 -> max(0.5, 0.9) = 0.9
    logp, old = _lp([1.5, 0.5])
    loss, _ = ppo_policy_loss(logp, old, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2),
                              clip_low=0.1, clip_high=0.28)
    torch.testing.assert_close(loss, torch.tensor((-1.28 + 0.9) / 2))


def test_dual_clip():
    # r=5 A=-1: PPO gives max(5, 1.2) = 5; dual clip bounds it by -A*c = 3.
    # r=5 A=+1: max(-5, -1.2) = -1.2, dual clip does not apply to A > 0.
    logp, old = _lp([5.0, 5.0])
    adv = torch.tensor([[-1.0, 1.0]])
    loss, st = ppo_policy_loss(logp, old, adv, torch.ones(1, 2), 0.2, 0.2, clip_c=3.0)
    torch.testing.assert_close(loss, torch.tensor((3.0 - 1.2) / 2))
    torch.testing.assert_close(st["dual_clip_frac"], torch.tensor(0.5))
    loss, st = ppo_policy_loss(logp, old, adv, torch.ones(1, 2), 0.2, 0.2, clip_c=None)
    torch.testing.assert_close(loss, torch.tensor((5.0 - 1.2) / 2))
    assert st["dual_clip_frac"] == 0
    with pytest.raises(ValueError):
        ppo_policy_loss(logp, old, adv, torch.ones(1, 2), 0.2, 0.2, clip_c=1.0)


def test_tis_weight_truncation():
    # logp = old (r = 1), A = +1, so each token's loss is -w.
    # pi_prox/pi_behav = 3 -> truncated to cap 2; = 0.5 -> kept.  loss = (-2 - 0.5) / 2 = -1.25
    old = torch.log(torch.tensor([[0.3, 0.1]]))
    behav = torch.log(torch.tensor([[0.1, 0.2]]))
    logp = old.clone().requires_grad_(True)
    loss, st = ppo_policy_loss(logp, old, torch.ones(1, 2), torch.ones(1, 2), 0.2, 0.2,
                               behav_logp=behav, tis_cap=2.0)
    torch.testing.assert_close(loss, torch.tensor(-1.25), check_dtype=False)
    torch.testing.assert_close(st["tis_weight_mean"], torch.tensor(1.25))
    torch.testing.assert_close(st["tis_truncated_frac"], torch.tensor(0.5))
    torch.testing.assert_close(st["tis_weight_max"], torch.tensor(3.0))
    # mean |old - behav| = (ln 3 + ln 2) / 2 = 0.895880
    torch.testing.assert_close(st["logp_mismatch"], torch.tensor((LN(3) + LN(2)) / 2))
    # the weight is a constant: d loss / d logp = -A * r * w / N = [-1, -0.25]
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, -0.25]]))
    # no cap: pure decoupled PPO, w = [3, 0.5] -> -1.75; no behaviour: standard PPO -> -1
    loss, st = ppo_policy_loss(old, old, torch.ones(1, 2), torch.ones(1, 2), 0.2, 0.2,
                               behav_logp=behav, tis_cap=None)
    torch.testing.assert_close(loss, torch.tensor(-1.75))
    assert st["tis_truncated_frac"] == 0
    loss, _ = ppo_policy_loss(old, old, torch.ones(1, 2), torch.ones(1, 2), 0.2, 0.2)
    torch.testing.assert_close(loss, torch.tensor(-1.0))


def test_tis_weight_never_overflows():
    old, behav = torch.tensor([[0.0]]), torch.tensor([[-200.0]])
    loss, st = ppo_policy_loss(old, old, torch.ones(1, 1), torch.ones(1, 1), 0.2, 0.2,
                               behav_logp=behav, tis_cap=None)
    assert torch.isfinite(loss) and torch.isfinite(st["tis_weight_max"])


# values [[1,2,3],[4,x,x],[x,x,x]] (x masked): tokens 1+2+3+4 over 4 tokens, 2 sequences
V = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [9.0, 9.0, 9.0]])
M = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])


@pytest.mark.parametrize("mode,want,denom", [
    ("token-mean", 10 / 4, 4),               # (1+2+3+4) / 4 tokens
    ("seq-mean-token-sum", (6 + 4) / 2, 2),  # per-seq sums 6, 4 over 2 sequences
    ("seq-mean-token-mean", (2 + 4) / 2, 2),  # per-seq means 2, 4 over 2 sequences
])
def test_aggregation_modes(mode, want, denom):
    torch.testing.assert_close(aggregate(V, M, mode), torch.tensor(want))
    assert global_denom(M, mode) == denom
    # a given denom is the batch normaliser: this tensor is then a share of a bigger batch
    torch.testing.assert_close(aggregate(V, M, mode, denom=2 * denom), torch.tensor(want / 2))
    torch.testing.assert_close(aggregate_entropy(V, M, mode), torch.tensor(want))


def test_all_masked_gives_zero_not_nan():
    z = torch.zeros(2, 3)
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        assert aggregate(V[:2], z, mode) == 0
        loss, st = ppo_policy_loss(V[:2], V[:2] - 1, torch.ones(2, 3), z, 0.2, 0.2,
                                   clip_c=3.0, behav_logp=V[:2], tis_cap=2.0, agg=mode)
        assert loss == 0 and all(torch.isfinite(v) for v in st.values())
    with pytest.raises(ValueError):
        aggregate(V, M, "seq-sum")


def _random_batch(B=5, T=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 3
    logp = old + 0.4 * torch.randn(B, T, generator=g)
    behav = old + 0.8 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    mask[2] = 0  # a row with no response (e.g. the worker's padding)
    return logp, old, behav, adv, mask


def _assert_shares_sum_to_batch(mode, seed=0, **extra):
    """Two micro-batches normalised by the whole batch's denominator add up to the batch."""
    logp, old, behav, adv, mask = _random_batch(seed=seed)
    kw = dict(clip_low=0.2, clip_high=0.28, clip_c=3.0, tis_cap=1.5, agg=mode, **extra)
    whole, st_whole = ppo_policy_loss(logp, old, adv, mask, behav_logp=behav, **kw)
    denom = global_denom(mask, mode)
    parts = [ppo_policy_loss(logp[s], old[s], adv[s], mask[s], behav_logp=behav[s],
                             denom=denom, **kw) for s in (slice(0, 2), slice(2, 5))]
    torch.testing.assert_close(sum(p[0] for p in parts), whole)
    for k, v in st_whole.items():
        combine = max if k.endswith("_max") else sum
        torch.testing.assert_close(combine(p[1][k] for p in parts), v, msg=k)
    return mask, denom


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_micro_batch_shares_sum_to_batch_value(mode):
    mask, denom = _assert_shares_sum_to_batch(mode)
    ent = torch.rand(5, 6)
    torch.testing.assert_close(
        sum(aggregate_entropy(ent[s], mask[s], mode, denom) for s in (slice(0, 2), slice(2, 5))),
        aggregate_entropy(ent, mask, mode))


@pytest.mark.parametrize("adv,sign", [(1.0, -1), (-1.0, 1)])
def test_gradient_sign(adv, sign):
    # minimising the loss moves logp along -grad: up for A > 0, down for A < 0
    old = torch.log(torch.tensor([[0.3, 0.5]]))
    logp = old.clone().requires_grad_(True)
    loss, _ = ppo_policy_loss(logp, old, torch.tensor([adv]), torch.ones(1, 2), 0.2, 0.2)
    loss.backward()
    assert (torch.sign(logp.grad) == sign).all()
    new = (logp - 0.1 * logp.grad).detach()
    assert ((new - old) * adv > 0).all()


def test_gradient_zero_once_clipped():
    # r = 1.5 > 1.2 with A > 0: the clipped branch is active, no further push up
    logp, old = _lp([1.5])
    logp.requires_grad_(True)
    loss, _ = ppo_policy_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 1), 0.2, 0.2)
    loss.backward()
    assert logp.grad.abs().max() == 0


def test_sequence_level_tis_weight():
    # row 0: response tokens 0, 1 with prox/behav = 3 and 0.5 -> one weight 1.5 on both;
    #        token 2 is masked and carries a junk behaviour log-prob (must not count).
    # row 1: no response. logp = old (r = 1), A = +1 -> loss = -w per token, token-mean -1.5
    old = torch.log(torch.tensor([[0.3, 0.1, 0.5], [0.2, 0.2, 0.2]]))
    behav = torch.log(torch.tensor([[0.1, 0.2, 1e-20], [0.2, 0.2, 0.2]]))
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    logp = old.clone().requires_grad_(True)
    loss, st = ppo_policy_loss(logp, old, torch.ones(2), mask, 0.2, 0.2, behav_logp=behav,
                               tis_cap=2.0, level="sequence")
    torch.testing.assert_close(loss, torch.tensor(-1.5))
    torch.testing.assert_close(st["tis_weight_mean"], torch.tensor(1.5))
    assert st["tis_truncated_frac"] == 0
    torch.testing.assert_close(st["tis_weight_max"], torch.tensor(1.5))
    # the per-token mismatch metric is the same at both levels: (ln 3 + ln 2) / 2
    torch.testing.assert_close(st["logp_mismatch"], torch.tensor((LN(3) + LN(2)) / 2))
    loss.backward()  # d/d logp = -A * w / 2 tokens on the response, 0 elsewhere
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.75, -0.75, 0], [0, 0, 0]]))
    # cap 1.2 truncates the whole sequence: w = 1.2, every token of it counts as truncated;
    # the max metric keeps the raw weight
    loss, st = ppo_policy_loss(old, old, torch.ones(2), mask, 0.2, 0.2, behav_logp=behav,
                               tis_cap=1.2, level="sequence")
    torch.testing.assert_close(loss, torch.tensor(-1.2))
    assert st["tis_truncated_frac"] == 1
    torch.testing.assert_close(st["tis_weight_max"], torch.tensor(1.5))
    # token level on the same data: w = [2 (capped), 0.5] -> -1.25
    loss, _ = ppo_policy_loss(old, old, torch.ones(2), mask, 0.2, 0.2, behav_logp=behav,
                              tis_cap=2.0, level="token")
    torch.testing.assert_close(loss, torch.tensor(-1.25))
    with pytest.raises(ValueError):
        ppo_policy_loss(old, old, torch.ones(2), mask, 0.2, 0.2, behav_logp=behav,
                        level="batch")


def test_sequence_level_never_overflows_and_all_masked_is_zero():
    old, behav = torch.zeros(1, 40), torch.full((1, 40), -50.0)  # sum of log w = 2000
    loss, st = ppo_policy_loss(old, old, torch.ones(1, 40), torch.ones(1, 40), 0.2, 0.2,
                               behav_logp=behav, tis_cap=None, level="sequence")
    assert torch.isfinite(loss) and torch.isfinite(st["tis_weight_max"])
    z = torch.zeros(2, 3)
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        loss, st = ppo_policy_loss(V[:2], V[:2] - 1, torch.ones(2, 3), z, 0.2, 0.2,
                                   behav_logp=V[:2], tis_cap=2.0, agg=mode, level="sequence")
        assert loss == 0 and all(torch.isfinite(v) for v in st.values())


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_sequence_level_micro_batch_shares(mode):
    _assert_shares_sum_to_batch(mode, seed=3, level="sequence")
