"""verl 0.9.1's bypass mode (``algorithm.rollout_correction.bypass_mode: true``): the policy
loss with the rollout engine's log-probs as the old policy.

Two policies instead of three: no proximal policy is recomputed (the LOGP state passes the
rollout log-probs through), and the loss measures the policy being trained, pi_theta,
against the behaviour policy pi_rollout directly. ``loss_type`` picks the loss, as verl's
``compute_policy_loss_bypass_mode`` (core_algos.py:2413-2549) does:

- ``ppo_clip``: vanilla PPO (clip, dual clip) with r = pi_theta / pi_rollout; the ratio is the
  importance correction, so no weight multiplies it (``rollout_is`` only adds metrics);
- ``reinforce``: -A * log pi_theta * w per token, w = sg[pi_theta / pi_rollout] bounded by
  ``rollout_is``/``rollout_is_threshold`` (TIS or IcePop; no weight when ``rollout_is`` is
  null): the importance-weighted policy gradient.

Rejection sampling (``rollout_rs``) is applied to each micro-batch against pi_theta, as verl
does: rejected tokens drop out of the policy loss; the loss's denominators stay the
mini-batch's own counts (verl's global batch info is taken before the loss runs), and
entropy and KL-to-reference keep every token. The weights and the rejections are computed
without a gradient.

Metrics (shares, summing over micro-batches to the mini-batch value): the policy loss's own
(``pg_loss``, and ``ppo_kl`` = mean of log pi_rollout - log pi_theta; ``ppo_clip`` adds
vanilla's clip fractions and ratios), and per valid token of the mini-batch
``rollout_corr/offpolicy/kl``, ``rollout_corr/offpolicy/k3_kl``,
``rollout_corr/offpolicy/chi2_token``, ``rollout_corr/is/mean`` (with ``rollout_is``) and
``rollout_corr/rs/masked_fraction`` (with ``rollout_rs``), pi_theta against pi_rollout. verl
computes its whole set on each micro-batch and averages them over micro-batches; the ones
that are not means over tokens (maxima, spreads, per-sequence summaries) have no exact
mini-batch value this way and are left out.
"""
from __future__ import annotations

import torch

from .aggregate import aggregate, stats_denom_for, stats_mode
from .policy_losses import PolicyLossParams, policy_loss
from .rollout_correction import (SAFETY_BOUND, RolloutCorrection, bound_weights, log_ratio,
                                 raw_is_weights, rejection_mask)


def bypass_policy_loss(logp: torch.Tensor, behav_logp: torch.Tensor, adv: torch.Tensor,
                       mask: torch.Tensor, rc: RolloutCorrection,
                       params: PolicyLossParams = PolicyLossParams(), *,
                       agg: str = "token-mean", denom: float | torch.Tensor | None = None,
                       stats_denom: float | torch.Tensor | None = None,
                       token_denom: float | torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The bypass-mode policy loss -> (loss, stats); see the module docstring.

    `logp` (with the gradient), `behav_logp`, `adv` (or [b]), `mask` [b, T]; `agg`, `denom`,
    `stats_denom` as in `losses.ppo_policy_loss` (the mini-batch's counts, before
    rejection); `token_denom` the mini-batch's valid tokens (`global_denom(mask,
    "token-mean")`), the normaliser of the ``rollout_corr/`` token means (None: this call's)."""
    mask = mask.float()
    lr = log_ratio(logp, behav_logp, mask)  # log(pi_theta / pi_rollout), detached
    w = None
    if rc.rollout_is is not None:
        raw, _ = raw_is_weights(lr, mask, rc.rollout_is)
        w = bound_weights(raw, rc.is_upper, rc.is_lower)
    kept = rejection_mask(lr, mask, rc.rs, with_metrics=False)[0] if rc.rs else mask
    if rc.loss_type == "ppo_clip":
        loss, stats = policy_loss("vanilla", logp, behav_logp, adv, kept, params, agg=agg,
                                  denom=denom, stats_denom=stats_denom)
    elif rc.loss_type == "reinforce":
        loss, stats = _reinforce(logp, behav_logp, adv, kept, w, agg, denom, stats_denom)
    else:
        raise ValueError(f"unknown bypass loss_type {rc.loss_type!r}")
    with torch.no_grad():
        def share(v: torch.Tensor) -> torch.Tensor:
            return aggregate(v, mask, "token-mean", token_denom)

        stats["rollout_corr/offpolicy/kl"] = share(-lr)
        stats["rollout_corr/offpolicy/k3_kl"] = share(torch.exp(lr) - lr - 1.0)
        stats["rollout_corr/offpolicy/chi2_token"] = share(
            torch.exp(lr.clamp(-SAFETY_BOUND, SAFETY_BOUND)).square() - 1.0)
        if w is not None:
            stats["rollout_corr/is/mean"] = share(w)
        if rc.rs:
            stats["rollout_corr/rs/masked_fraction"] = share(1.0 - kept)
    return loss, {k: v.detach() for k, v in stats.items()}


def _reinforce(logp, behav_logp, adv, mask, w, agg, denom, stats_denom):
    """-A * logp * w aggregated over `mask` (the kept tokens) with the batch's `denom`."""
    logp = logp.float()
    adv = adv.detach().float()
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)
    per_token = -adv.expand_as(logp) * logp
    if w is not None:
        per_token = per_token * w
    smode = stats_mode(agg)
    stats_denom = stats_denom_for(agg, denom, stats_denom)
    loss = aggregate(per_token, mask, agg, denom)
    with torch.no_grad():
        kl = behav_logp.detach().float() - logp.detach()
        stats = {"pg_loss": loss.detach(), "ppo_kl": aggregate(kl, mask, smode, stats_denom)}
    return loss, stats


__all__ = ["bypass_policy_loss"]
