"""Per-token KL estimators between the policy and a reference, from log-probs only.

With d = logp - ref_logp (log pi(x) - log pi_ref(x), x sampled from pi), Schulman's estimators
of KL(pi || pi_ref):

| kind                  | value                          | notes |
|-----------------------|--------------------------------|-------|
| ``k1`` / ``kl``       | d                              | unbiased, high variance, can be < 0 |
| ``k2`` / ``mse``      | d**2 / 2                       | biased, low variance, >= 0 |
| ``k3`` / ``low_var_kl`` | exp(-d) - 1 + d              | unbiased, >= 0; clamped (below) |
| ``abs``               | abs(d)                         | |

k3 is clamped as verl does: -d is clamped to [-20, 20] before the exp (no overflow), and the
result to [-10, 10], so one wild token cannot dominate the loss. Values are per token [b, T];
aggregate with `megarl.algo.aggregate.aggregate`.

Straight-through kinds (verl's ``+`` suffix, e.g. ``k3+`` / ``low_var_kl+``): the value is the
base kind's (clamps included), the gradient w.r.t. logp is k2's, d, computed as
k2 - k2.detach() + base.detach(). The reason (Schulman's note): k1 and k3 are unbiased
estimates of the KL's *value*, but the expected gradient of the k3 loss is not the KL's
gradient, while k2's is; ``+`` keeps an unbiased logged value and takes k2's gradient.
``k2+`` / ``mse+`` are k2 itself. In the reward (no gradient) a ``+`` kind is its base kind.

KL in the reward (PPO style, ``algorithm.use_kl_in_reward``) instead of in the loss:
`apply_kl_in_reward` turns scores into token rewards r[i, t] - coef * k[i, t] over the response;
`adaptive_kl_coef` is the adaptive controller's update (Ziegler et al. 2019), a pure function
of the current coefficient so the caller owns its state.
"""
from __future__ import annotations

import torch

from .advantages import token_rewards

_BASE_KINDS = ("k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs")
KL_KINDS = _BASE_KINDS + tuple(k + "+" for k in _BASE_KINDS)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "low_var_kl"
               ) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate of `kind` (see the module table; a ``+`` kind
    has the base kind's value and k2's gradient)."""
    if kind.endswith("+") and kind[:-1] in _BASE_KINDS:
        value = _kl_value(logp, ref_logp, kind[:-1])
        k2 = _kl_value(logp, ref_logp, "k2")
        return k2 - k2.detach() + value.detach()
    return _kl_value(logp, ref_logp, kind)


def _kl_value(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    d = logp - ref_logp
    if kind in ("k1", "kl"):
        return d
    if kind in ("k2", "mse"):
        return 0.5 * d.square()
    if kind in ("k3", "low_var_kl"):
        neg = torch.clamp(-d, min=-20.0, max=20.0)  # log(pi_ref / pi)
        return torch.clamp(torch.exp(neg) - neg - 1.0, min=-10.0, max=10.0)
    if kind == "abs":
        return d.abs()
    raise ValueError(f"unknown KL kind {kind!r}; choose from {KL_KINDS}")


def apply_kl_in_reward(rewards: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor,
                       response_mask: torch.Tensor, kind: str = "kl", coef: float = 0.001
                       ) -> tuple[torch.Tensor, dict[str, float]]:
    """Token rewards [N, T] = token_rewards(rewards) - coef * kl_penalty(logp, ref_logp, kind).

    `rewards` is [N] (each score lands on its sample's last response token) or [N, T]; the
    penalty applies on every response token and nothing outside the response. `logp` is the
    proximal policy's (LOGP's recompute of the weights the step trains from, as verl's
    `old_log_probs`), without gradient.
    Metrics: ``reward/kl_penalty`` (the mean over samples of each sample's token-mean KL,
    i.e. the ``current_kl`` that `adaptive_kl_coef` wants) and ``reward/kl_coef``."""
    mask = response_mask.float()
    kl = kl_penalty(logp.detach().float(), ref_logp.detach().float(), kind) * mask
    out = token_rewards(rewards, mask) - coef * kl
    n_tok = mask.sum(-1)
    has = n_tok > 0
    per_seq = kl.sum(-1)[has] / n_tok[has]
    current = float(per_seq.mean()) if bool(has.any()) else 0.0
    return out, {"reward/kl_penalty": current, "reward/kl_coef": float(coef)}


def adaptive_kl_coef(coef: float, current_kl: float, target_kl: float, n_steps: int,
                     horizon: int) -> float:
    """One update of the adaptive KL controller (``algorithm.kl_ctrl.type: adaptive``):
    coef * (1 + clip(current_kl / target_kl - 1, -0.2, 0.2) * n_steps / horizon).

    `n_steps` is the number of samples (verl's convention) seen since the last update."""
    if target_kl <= 0 or horizon <= 0:
        raise ValueError(f"need target_kl > 0 and horizon > 0, got {target_kl}, {horizon}")
    err = min(max(current_kl / target_kl - 1.0, -0.2), 0.2)
    return coef * (1.0 + err * n_steps / horizon)
