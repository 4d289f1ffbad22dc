"""Seeded Monte Carlo check of the off-policy correction in `ppo_policy_loss`.

Synthetic stale data: a small categorical policy; samples drawn from a *behaviour* policy mu
(stale weights) that differs from the proximal policy pi_prox; the policy being trained
pi_theta sits a little away from pi_prox, inside the clip range (so clipping is inactive and
the PPO surrogate is smooth). The target is the gradient that fresh data would give, the
importance-weighted on-policy gradient

    g* = grad_theta E_{x ~ pi_prox}[ sum_t (pi_theta / pi_prox)(x_t) A(x) ]

computed exactly by enumeration. The loss's gradient on N samples from mu is averaged and
compared with -g* (the loss is minimised) in units of its Monte Carlo standard error: the
decoupled weight (and TIS with a cap it never reaches) must land within 4 SE; the naive loss
(no behaviour log-probs: w = 1, i.e. recomputed log-probs standing in for the behaviour policy)
must miss by more than 10 SE.
"""
import torch

from megarl.algo.losses import ppo_policy_loss

K = 5
N = 200_000


def _policies(seed):
    g = torch.Generator().manual_seed(seed)
    prox = torch.randn(K, generator=g)                       # pi_prox logits
    theta = prox + 0.04 * torch.randn(K, generator=g)        # pi_theta: ratios within 1 +- 0.2
    behav = prox + 1.0 * torch.randn(K, generator=g)         # stale behaviour policy
    return g, theta, prox, behav


def _mc_grad(theta, tokens, old_lp, behav_lp, adv, agg, **kw):
    """(mean gradient of the loss wrt theta, its standard error), from per-sample parts."""
    lp_all = torch.log_softmax(theta, -1)
    leaf = lp_all[tokens].clone().requires_grad_(True)     # [N, T], leaf for per-sample grads
    loss, _ = ppo_policy_loss(leaf, old_lp, adv, torch.ones_like(leaf), 0.2, 0.2, clip_c=3.0,
                              agg=agg, **kw)
    (dl,) = torch.autograd.grad(loss, leaf)
    # d log softmax(theta)[k] / d theta = onehot(k) - pi_theta
    jac = torch.nn.functional.one_hot(tokens, K).float() - lp_all.exp()
    parts = tokens.shape[0] * (dl.unsqueeze(-1) * jac).sum(1)  # [N, K], mean = loss grad
    return parts.mean(0), parts.std(0) / parts.shape[0] ** 0.5


def _check(est, se, target, ok):
    z = ((est - target).abs() / se).max().item()
    assert (z < 4) if ok else (z > 10), f"max |est - target| / SE = {z:.1f}"


def test_token_level_decoupled_and_tis_match_fresh_gradient_naive_does_not():
    g, theta, prox, behav = _policies(0)
    reward = torch.randn(K, generator=g)
    lp_theta, lp_prox, lp_mu = (torch.log_softmax(x, -1) for x in (theta, prox, behav))
    ratio = (lp_theta - lp_prox).exp()
    assert ((ratio > 0.8) & (ratio < 1.2)).all()  # no clipping: the surrogate is smooth
    # exact target: grad of sum_a pi_prox(a) r(a) A(a), negated (the loss is minimised)
    th = theta.clone().requires_grad_(True)
    j = (lp_prox.exp() * (torch.log_softmax(th, -1) - lp_prox).exp() * reward).sum()
    (target,) = torch.autograd.grad(-j, th)

    x = torch.multinomial(lp_mu.exp(), N, replacement=True, generator=g).unsqueeze(-1)
    args = (theta, x, lp_prox[x], lp_mu[x], reward[x], "token-mean")
    w_max = (lp_prox - lp_mu).exp().max().item()
    assert w_max > 1.5  # the behaviour policy really is stale
    _check(*_mc_grad(*args, behav_logp=lp_mu[x], tis_cap=None), target, ok=True)
    _check(*_mc_grad(*args, behav_logp=lp_mu[x], tis_cap=1.01 * w_max), target, ok=True)
    _check(*_mc_grad(*args), target, ok=False)  # naive: no behaviour log-probs


def test_sequence_level_weight_matches_fresh_gradient_for_sequence_rewards():
    # two-token responses, tokens drawn independently from the same categorical; the advantage
    # depends on both tokens (not separable), aggregated with seq-mean-token-sum
    g, theta, prox, behav = _policies(1)
    table = torch.randn(K, K, generator=g)
    lp_theta, lp_prox, lp_mu = (torch.log_softmax(x, -1) for x in (theta, prox, behav))
    th = theta.clone().requires_grad_(True)
    r = (torch.log_softmax(th, -1) - lp_prox).exp()
    p = lp_prox.exp()
    j = (p[:, None] * p[None, :] * (r[:, None] + r[None, :]) * table).sum()
    (target,) = torch.autograd.grad(-j, th)

    x = torch.multinomial(lp_mu.exp(), 2 * N, replacement=True, generator=g).view(N, 2)
    args = (theta, x, lp_prox[x], lp_mu[x], table[x[:, 0], x[:, 1]], "seq-mean-token-sum")
    _check(*_mc_grad(*args, behav_logp=lp_mu[x], tis_cap=None, level="sequence"), target,
           ok=True)
    _check(*_mc_grad(*args), target, ok=False)  # naive
    # the per-token weight is the usual approximation: biased for a non-separable reward
    _check(*_mc_grad(*args, behav_logp=lp_mu[x], tis_cap=None, level="token"), target,
           ok=False)
