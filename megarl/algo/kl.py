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
"""
from __future__ import annotations

import torch

KL_KINDS = ("k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs")


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "low_var_kl"
               ) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate of `kind` (see the module table)."""
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
