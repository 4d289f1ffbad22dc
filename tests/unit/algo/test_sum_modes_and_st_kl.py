"""The aggregation modes whose loss normaliser is not the stats' count (token-sum,
seq-mean-token-sum-norm; see also test_seq_mean_token_sum_norm_verl.py) and the
straight-through KL kinds (k3+, low_var_kl+, ...), against hand-computed values on ragged
masks, and their micro-batch / data-parallel shares."""
import math

import pytest
import torch
from omegaconf import OmegaConf

from megarl.algo.actor_loss import make_actor_loss, make_actor_loss_from_config
from megarl.algo.aggregate import aggregate, global_denom, stats_mode
from megarl.algo.kl import apply_kl_in_reward, kl_penalty
from megarl.algo.losses import ppo_policy_loss
from megarl.config import ConfigError, load_config
from megarl.config.schema import ActorConfig

LN2 = math.log(2)
SUM_MODES = ["token-sum", "seq-mean-token-sum-norm"]
ALL_MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", *SUM_MODES]

# values [[1,2,3],[4,x,x],[x,x,x]] (x masked): token sum 1+2+3+4 = 10
V = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [9.0, 9.0, 9.0]])
M = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])


def test_token_sum_is_the_plain_masked_sum():
    assert global_denom(M, "token-sum") == 1.0
    torch.testing.assert_close(aggregate(V, M, "token-sum"), torch.tensor(10.0))
    assert aggregate(V, torch.zeros(3, 3), "token-sum") == 0
    assert stats_mode("token-sum") == "token-mean"


def test_seq_mean_token_sum_norm_is_the_sequence_mean_over_the_constant():
    # verl 0.9.1 core_algos.py:1181-1193: mean over the 2 valid rows of the row sums (6, 4),
    # then / C: D = 2 sequences * C
    assert global_denom(M, "seq-mean-token-sum-norm", loss_scale_factor=5) == 10.0
    torch.testing.assert_close(aggregate(V, M, "seq-mean-token-sum-norm", denom=10.0),
                               torch.tensor((6 + 4) / 2 / 5))
    # no constant given: verl's fallback, the padded width (3 here)
    assert global_denom(M, "seq-mean-token-sum-norm") == 6.0
    torch.testing.assert_close(aggregate(V, M, "seq-mean-token-sum-norm"),
                               torch.tensor((6 + 4) / 2 / 3))
    assert stats_mode("seq-mean-token-sum-norm") == "seq-mean-token-mean"
    with pytest.raises(ValueError):
        global_denom(M, "seq-mean-token-sum-norm", loss_scale_factor=0)


@pytest.mark.parametrize("mode,whole", [("token-mean", 4), ("seq-mean-token-sum", 2),
                                        ("token-sum", 1), ("seq-mean-token-sum-norm", 2 * 5)])
def test_dp_size_divides_the_batch_normaliser(mode, whole):
    assert global_denom(M, mode, loss_scale_factor=5, dp_size=2) == whole / 2


def _ragged():
    """Row 0: ratios 1.5, 0.5, 1.0, A = +1; row 1: ratio 1.5 on its one token, A = -1;
    row 2: no response. Positions off the mask hold junk ratios."""
    old = torch.full((3, 3), math.log(0.1))
    ratios = torch.tensor([[1.5, 0.5, 1.0], [1.5, 7.0, 7.0], [7.0, 7.0, 7.0]])
    logp = (old + ratios.log()).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 5.0])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.float32)
    return logp, old, adv, mask


# Per token, eps 0.2: r=1.5 A=+1 -> max(-1.5, -1.2) = -1.2 (clipped, no gradient);
# r=0.5 A=+1 -> max(-0.5, -0.8) = -0.5 (d/dlogp = -A r = -0.5); r=1 A=+1 -> -1 (grad -1);
# r=1.5 A=-1 -> max(1.5, 1.2) = 1.5 (grad +1.5; dual clip bound 3 not reached).
# Masked sum: -1.2 - 0.5 - 1 + 1.5 = -1.2.
GRAD_SUM = torch.tensor([[0.0, -0.5, -1.0], [1.5, 0.0, 0.0], [0.0, 0.0, 0.0]])


# D: token-sum 1; seq-mean-token-sum-norm 2 valid sequences * C = 4
@pytest.mark.parametrize("mode,c", [("token-sum", 1.0), ("seq-mean-token-sum-norm", 2 * 4.0)])
def test_ppo_loss_value_gradient_and_stats(mode, c):
    logp, old, adv, mask = _ragged()
    loss, st = ppo_policy_loss(logp, old, adv, mask, 0.2, 0.2, clip_c=3.0, agg=mode,
                               denom=global_denom(mask, mode, loss_scale_factor=4.0),
                               stats_denom=global_denom(mask, stats_mode(mode)))
    torch.testing.assert_close(loss, torch.tensor(-1.2 / c))
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, GRAD_SUM / c)
    if mode == "token-sum":  # stats are token means over the 4 valid tokens
        torch.testing.assert_close(st["clip_frac"], torch.tensor(1 / 4))
        torch.testing.assert_close(st["ratio_mean"], torch.tensor((1.5 + 0.5 + 1 + 1.5) / 4))
    else:  # per-sequence means (row 0: 1/3 clipped, mean ratio 1; row 1: 0, 1.5) over 2 rows
        torch.testing.assert_close(st["clip_frac"], torch.tensor((1 / 3 + 0) / 2))
        torch.testing.assert_close(st["ratio_mean"], torch.tensor((1.0 + 1.5) / 2))


def test_constant_modes_need_a_stats_denom_with_a_batch_denom():
    logp, old, adv, mask = _ragged()
    with pytest.raises(ValueError, match="stats_denom"):
        ppo_policy_loss(logp, old, adv, mask, 0.2, 0.2, agg="token-sum", denom=1.0)
    with pytest.raises(ValueError, match="stats_denom"):
        make_actor_loss(clip_ratio_low=0.2, clip_ratio_high=0.2,
                        loss_agg_mode="seq-mean-token-sum-norm", denom=8.0)


def _batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    B, S = 6, 7
    old = -torch.rand(B, S, generator=g) * 2
    mask = torch.zeros(B, S)
    for i, start in enumerate([2, 3, 4, 2, 5, 7]):  # row 5: no response at all
        mask[i, start:] = 1
    mask[0, 4] = 0  # a hole inside a response
    batch = {"response_mask": mask, "advantages": torch.randn(B, generator=g),
             "old_logprobs": old, "rollout_logprobs": old + 0.5 * torch.randn(B, S, generator=g),
             "ref_logprobs": old + 0.3 * torch.randn(B, S, generator=g)}
    logp = (old + 0.3 * torch.randn(B, S, generator=g)).requires_grad_(True)
    return batch, logp, torch.rand(B, S, generator=g)


KW = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, entropy_coeff=0.01,
          use_kl_loss=True, kl_loss_coef=0.05, kl_loss_type="k3+", tis_imp_ratio_cap=2.0)


def _loss_fn(mode, whole_mask, dp_size=1):
    return make_actor_loss(**KW, loss_agg_mode=mode, with_max_metrics=False,
                           denom=global_denom(whole_mask, mode, 6.0, dp_size),
                           stats_denom=global_denom(whole_mask, stats_mode(mode),
                                                    dp_size=dp_size))


@pytest.mark.parametrize("mode", SUM_MODES)
def test_micro_batch_shares_sum_to_the_batch(mode):
    batch, logp, ent = _batch()
    mask = batch["response_mask"]
    whole, m_whole = _loss_fn(mode, mask)(logp, ent, batch)
    (g_whole,) = torch.autograd.grad(whole, logp)
    fn = _loss_fn(mode, mask)
    parts = [fn(logp[s], ent[s], {k: v[s] for k, v in batch.items()})
             for s in (slice(0, 1), slice(1, 4), slice(4, 6))]
    total = sum(p[0] for p in parts)
    torch.testing.assert_close(total, whole)
    (g_parts,) = torch.autograd.grad(total, logp)
    torch.testing.assert_close(g_parts, g_whole)
    for k, v in m_whole.items():
        torch.testing.assert_close(sum(p[1][k] for p in parts), v, msg=k)
    # the stats stay means: a fraction is a fraction, whatever the loss's normaliser
    assert 0 <= float(m_whole["actor/pg_clipfrac"]) <= 1


@pytest.mark.parametrize("mode", ALL_MODES)
def test_data_parallel_average_is_the_batch(mode):
    """Two replicas with unequal shards (11 and 7 valid tokens), each split into
    micro-batches and normalised by the whole mini-batch's D / 2: the average of their
    losses, gradients and metrics (what the optimizer and MegatronGroup.train take) is the
    whole mini-batch's."""
    batch, logp, ent = _batch()
    mask = batch["response_mask"]
    whole, m_whole = _loss_fn(mode, mask)(logp, ent, batch)
    (g_whole,) = torch.autograd.grad(whole, logp)
    fn = _loss_fn(mode, mask, dp_size=2)
    replicas = []
    for micro in ([slice(0, 2), slice(2, 3)], [slice(3, 5), slice(5, 6)]):
        parts = [fn(logp[s], ent[s], {k: v[s] for k, v in batch.items()}) for s in micro]
        replicas.append((sum(p[0] for p in parts),
                         {k: sum(p[1][k] for p in parts) for k in m_whole}))
    mean_loss = (replicas[0][0] + replicas[1][0]) / 2
    torch.testing.assert_close(mean_loss, whole)
    (g_mean,) = torch.autograd.grad(mean_loss, logp)
    torch.testing.assert_close(g_mean, g_whole)
    for k, v in m_whole.items():
        torch.testing.assert_close((replicas[0][1][k] + replicas[1][1][k]) / 2, v, msg=k)


# --- straight-through KL -------------------------------------------------------------------
# token 0: pi = 0.5, pi_ref = 0.25 -> d = logp - ref = +ln 2; token 1: d = -ln 2;
# token 2: d = -30 (k3 clamps: -d -> 20, exp(20) - 21 > 10 -> 10); token 3 masked (junk).
REF = torch.log(torch.tensor([[0.25, 0.5, 1.0, 1.0]]))
D = torch.tensor([[LN2, -LN2, -30.0, 3.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
K3 = [0.5 - 1 + LN2, 2 - 1 - LN2, 10.0, math.exp(-3) - 1 + 3]  # exp(-d) - 1 + d, clamped


def _logp():
    return (REF + D).clone().requires_grad_(True)


@pytest.mark.parametrize("kind", ["k3+", "low_var_kl+"])
def test_k3_plus_has_k3_value_and_k2_gradient(kind):
    logp = _logp()
    out = kl_penalty(logp, REF, kind)
    torch.testing.assert_close(out.detach(), torch.tensor([K3]))
    # d(sum_t m_t k_t)/d logp_t = m_t * d_t: k2's gradient (d^2/2)' = d, zero off the mask
    (grad,) = torch.autograd.grad(aggregate(out, MASK, "token-sum"), logp)
    torch.testing.assert_close(grad, torch.tensor([[LN2, -LN2, -30.0, 0.0]]))
    # plain k3 differs: its gradient 1 - exp(-d) is 0.5, -1, and 0 where clamped
    logp = _logp()
    (g_k3,) = torch.autograd.grad(aggregate(kl_penalty(logp, REF, "k3"), MASK, "token-sum"),
                                  logp)
    torch.testing.assert_close(g_k3, torch.tensor([[0.5, -1.0, 0.0, 0.0]]))


@pytest.mark.parametrize("kind,value", [
    ("k1+", [LN2, -LN2, -30.0, 3.0]),
    ("abs+", [LN2, LN2, 30.0, 3.0]),
    ("k2+", [LN2 ** 2 / 2, LN2 ** 2 / 2, 450.0, 4.5]),
])
def test_other_plus_kinds(kind, value):
    logp = _logp()
    out = kl_penalty(logp, REF, kind)
    torch.testing.assert_close(out.detach(), torch.tensor([value]))
    (grad,) = torch.autograd.grad(out.sum(), logp)
    torch.testing.assert_close(grad, D)


def test_k3_plus_in_the_actor_loss_on_a_ragged_mask():
    # token-mean over the 3 valid tokens: kl_loss = sum(K3[:3]) / 3; gradient of the KL term
    # coef * d_t / 3 on valid tokens. logp == old (ratio 1) and A = 0, so pg adds nothing.
    logp = _logp()
    mb = {"response_mask": MASK, "advantages": torch.zeros(1),
          "old_logprobs": logp.detach().clone(), "ref_logprobs": REF}
    fn = make_actor_loss(clip_ratio_low=0.2, clip_ratio_high=0.2, use_kl_loss=True,
                         kl_loss_coef=0.1, kl_loss_type="k3+")
    loss, m = fn(logp, None, mb)
    torch.testing.assert_close(m["actor/kl_loss"], torch.tensor(sum(K3[:3]) / 3))
    torch.testing.assert_close(loss, torch.tensor(0.1 * sum(K3[:3]) / 3))
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, torch.tensor([[LN2, -LN2, -30.0, 0.0]]) * 0.1 / 3)


def test_plus_kinds_in_the_reward_are_their_base_kinds():
    logp = _logp().detach()
    scores = torch.tensor([1.0])
    out, m = apply_kl_in_reward(scores, logp, REF, MASK, "k3+", 0.1)
    base, m_base = apply_kl_in_reward(scores, logp, REF, MASK, "k3", 0.1)
    torch.testing.assert_close(out, base)
    assert m == m_base
    # score on the last valid token (index 2), -0.1 * k3 on every valid token
    want = torch.tensor([[-0.1 * K3[0], -0.1 * K3[1], 1.0 - 0.1 * K3[2], 0.0]])
    torch.testing.assert_close(out, want)


# --- config ------------------------------------------------------------------------------
ACT = "actor_rollout_ref.actor"


@pytest.mark.parametrize("override", [
    f"{ACT}.loss_agg_mode=token-sum", f"{ACT}.loss_agg_mode=seq-mean-token-sum-norm",
    f"{ACT}.kl_loss_type=k3+", f"{ACT}.kl_loss_type=low_var_kl+",
    "algorithm.kl_penalty=low_var_kl+",
])
def test_config_accepts_the_new_names(override):
    key, value = override.split("=")
    assert OmegaConf.select(load_config(None, [override]), key) == value


def test_loss_scale_factor_must_be_positive():
    cfg = load_config(None, [f"{ACT}.loss_scale_factor=512"])
    assert cfg.actor_rollout_ref.actor.loss_scale_factor == 512
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{ACT}.loss_scale_factor=0"])
    assert str(err.value).startswith(f"{ACT}.loss_scale_factor:")
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{ACT}.kl_loss_type=k4+"])
    assert str(err.value).startswith(f"{ACT}.kl_loss_type:")


def test_from_config_with_a_sum_mode():
    cfg = OmegaConf.structured(ActorConfig)
    cfg.loss_agg_mode = "seq-mean-token-sum-norm"
    logp, old, adv, mask = _ragged()
    mb = {"response_mask": mask, "advantages": adv, "old_logprobs": old}
    denom = global_denom(mask, cfg.loss_agg_mode, 4.0)  # 2 sequences * C = 4
    assert denom == 8.0
    loss, _ = make_actor_loss_from_config(cfg, denom=denom, stats_denom=2.0)(logp, None, mb)
    torch.testing.assert_close(loss, torch.tensor(-1.2 / 8))
