"""The PPO policy loss with decoupled off-policy correction, and the entropy aggregate.

Three policies meet in the loss (DESIGN.md §2); every tensor is per token [b, T]:
- ``logp``:       the policy being trained, pi_theta (the only tensor with a gradient);
- ``old_logp``:   the *proximal* policy pi_prox: log-probs recomputed by the trainer in the
                  LOGP state with the weights before this update;
- ``behav_logp``: the *behaviour* policy pi_behav: the rollout engine's own log-probs of the
                  tokens it sampled (possibly under older weights, other kernels, other
                  precision). Never substitute recomputed log-probs for it on stale data.

Per-token objective (a loss, to minimise), with A the advantage, eps_lo/eps_hi the clip
ranges (`clip_low`, `clip_high`; DAPO's clip-higher sets eps_hi > eps_lo), c the dual-clip
bound (`clip_c` > 1):

    r     = exp(logp - old_logp)                          (ratio to the proximal policy)
    l     = max(-A * r, -A * clip(r, 1 - eps_lo, 1 + eps_hi))      (PPO clip, on proximal)
    l     = min(l, -A * c)   where A < 0, if clip_c is given       (dual clip)
    w     = min(exp(old_logp - behav_logp), tis_cap)   detached    (truncated IS weight)
    loss_token = w * l

`level="sequence"` replaces the per-token w by one weight per sequence,
w_i = min(exp(sum_t m[i,t] (old_logp - behav_logp)[i,t]), tis_cap), on all of row i's tokens:
the exact importance ratio of the whole response, unbiased for a sequence-level objective
(e.g. an outcome reward under seq-mean-token-sum) when untruncated, at the price of a variance
that grows with the length; the token level (default) is the usual lower-variance, biased
per-token approximation.

This is decoupled PPO (AReaL, Fu et al. 2025): the trust region is measured against the
proximal policy, and the mismatch between proximal and behaviour policy is corrected by the
importance weight w, truncated at `tis_cap` as in TIS (Yao et al. 2025). `tis_cap=None`
means no truncation (pure decoupled PPO). `behav_logp=None` means w = 1: standard PPO, where
the proximal policy is assumed to have generated the data (right only for fresh, on-policy
samples from an engine that matches the trainer). AReaL masks tokens whose weight exceeds
the cap instead of truncating them; we truncate.

Aggregation: `megarl.algo.aggregate` (token-mean, seq-mean-token-sum, seq-mean-token-mean,
seq-mean-token-sum-norm, token-sum), with `denom` the batch-level normaliser so a micro-batch
returns its share of the batch loss.

Stats (detached 0-d tensors). *Shares*, aggregated over the valid tokens with
`aggregate.stats_mode(agg)` (a token mean under token-mean/token-sum, else a sequence mean)
and `stats_denom` (the loss's `denom` for the count modes), so summing them over the
micro-batches of a batch gives the batch value:
``pg_loss`` (the loss itself, aggregated with `agg`), ``clip_frac`` (tokens where the clipped
branch is active), ``dual_clip_frac`` (tokens where the dual clip is active), ``ppo_kl``
(k1 estimate of KL(pi_prox || pi_theta), mean of old_logp - logp), ``ratio_mean``, and when
`behav_logp` is given ``tis_weight_mean`` (mean w after truncation), ``tis_truncated_frac``
(tokens with raw weight > cap; at the sequence level each token of a truncated sequence) and
``logp_mismatch`` (per-token mean abs(old_logp - behav_logp), at either level).
*Maxima* (reduce with max, not sum; names in `MAX_STATS`): ``ratio_max`` and, with
`behav_logp`, ``tis_weight_max`` (the raw, untruncated weight).
"""
from __future__ import annotations

import math

import torch

from .aggregate import aggregate, stats_denom_for, stats_mode

MAX_STATS = ("ratio_max", "tis_weight_max")
_LOG_CLAMP = 20.0  # exp(20) ~ 5e8: keeps ratios finite without touching realistic values


def _masked_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    valid = mask > 0
    if not bool(valid.any()):
        return x.new_zeros(())
    return x[valid].max()


TIS_LEVELS = ("token", "sequence")


def behaviour_weight(old_logp: torch.Tensor, behav_logp: torch.Tensor, cap: float | None,
                     mask: torch.Tensor | None = None, level: str = "token"
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w, raw log-weight, truncated?), all [b, T], detached, w = min(pi_prox / pi_behav, cap).

    ``level="token"``: per token, log w = old - behav. ``level="sequence"``: one weight per
    row, log w = sum over the row's masked tokens of (old - behav), i.e. the ratio of the
    whole response's probabilities, broadcast to every token of the row (needs `mask`).
    Computed in log space (min(exp(x), cap) = exp(min(x, log cap))) so it never overflows."""
    if level not in TIS_LEVELS:
        raise ValueError(f"unknown TIS level {level!r}; choose from {TIS_LEVELS}")
    log_w = (old_logp - behav_logp).detach()
    if level == "sequence":
        if mask is None:
            raise ValueError("sequence-level importance weights need the response mask")
        log_w = (log_w * mask).sum(-1, keepdim=True).expand_as(log_w)
    capped = log_w.clamp(-_LOG_CLAMP, _LOG_CLAMP)  # verl's rollout_is clamps both sides too
    if cap is None:
        truncated = torch.zeros_like(log_w, dtype=torch.bool)
    else:
        if cap <= 0:
            raise ValueError(f"tis_cap must be > 0, got {cap}")
        truncated = log_w > math.log(cap)
        capped = capped.clamp(max=math.log(cap))
    return torch.exp(capped), log_w, truncated


def behaviour_correction(old_logp: torch.Tensor, behav_logp: torch.Tensor, cap: float | None,
                         mask: torch.Tensor, level: str, smode: str,
                         stats_denom: float | torch.Tensor | None
                         ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(w, its stats): the detached weight `behaviour_weight` gives, and the diagnostics of the
    correction (``tis_weight_mean``, ``tis_truncated_frac``, ``logp_mismatch`` as shares under
    `smode` / `stats_denom`, ``tis_weight_max`` the raw weight's maximum). One place for them,
    so every policy loss mode (`megarl.algo.policy_losses`) reports the correction alike."""
    old_logp = old_logp.detach().float()
    behav_logp = behav_logp.detach().float()
    w, log_w, truncated = behaviour_weight(old_logp, behav_logp, cap, mask, level)
    stats = {"tis_weight_mean": aggregate(w, mask, smode, stats_denom),
             "tis_truncated_frac": aggregate(truncated.to(mask.dtype), mask, smode,
                                             stats_denom),
             "logp_mismatch": aggregate((old_logp - behav_logp).abs(), mask, smode,
                                        stats_denom),
             "tis_weight_max": _masked_max(torch.exp(log_w.clamp(max=_LOG_CLAMP)), mask)}
    return w, stats


def given_weight_correction(weights: torch.Tensor, old_logp: torch.Tensor,
                            behav_logp: torch.Tensor | None, mask: torch.Tensor, smode: str,
                            stats_denom: float | torch.Tensor | None
                            ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(w, its stats) when the weights come with the batch (``rollout_is_weights``: verl's
    ``algorithm.rollout_correction.rollout_is``, computed over the whole step's batch by
    `megarl.algo.rollout_correction`): ``tis_weight_mean`` and ``tis_weight_max`` of the
    weight applied, ``logp_mismatch`` as `behaviour_correction`'s (with `behav_logp`)."""
    w = weights.detach().float()
    stats = {"tis_weight_mean": aggregate(w, mask, smode, stats_denom),
             "tis_weight_max": _masked_max(w, mask)}
    if behav_logp is not None:
        diff = (old_logp.detach().float() - behav_logp.detach().float()).abs()
        stats["logp_mismatch"] = aggregate(diff, mask, smode, stats_denom)
    return w, stats


def ppo_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor,
                    mask: torch.Tensor, clip_low: float, clip_high: float,
                    clip_c: float | None = None, behav_logp: torch.Tensor | None = None,
                    tis_cap: float | None = None, agg: str = "token-mean",
                    denom: float | torch.Tensor | None = None, level: str = "token",
                    stats_denom: float | torch.Tensor | None = None,
                    is_weights: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped (dual-clip, decoupled, TIS-weighted) PPO loss -> (loss, stats); see module doc.

    All tensors [b, T] (adv may be [b], broadcast over the row); `mask` is 1 on the tokens
    that count. Only `logp` should carry a gradient; the others are detached here anyway.
    `level` ("token" | "sequence") picks the importance weight (`behaviour_weight`).
    `stats_denom` is the batch normaliser of the stats (`global_denom(batch_mask,
    stats_mode(agg))`); None means `denom`, which is right for the count modes only, so a
    mode whose loss normaliser is not the stats' count (`CONSTANT_DENOM_MODES`: token-sum's
    1, seq-mean-token-sum-norm's sequences * C) with a batch `denom` needs it.
    `is_weights` [b, T]: importance weights given with the batch, used as w instead of
    `behaviour_weight`'s (`given_weight_correction`)."""
    if not 0 <= clip_low < 1 or clip_high < 0:
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, "
                         f"{clip_high}")
    if clip_c is not None and clip_c <= 1:
        raise ValueError(f"dual-clip bound clip_c must be > 1, got {clip_c}")
    logp = logp.float()
    old_logp = old_logp.detach().float()
    adv = adv.detach().float()
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)
    adv = adv.expand_as(logp)
    mask = mask.to(logp.dtype)

    log_ratio = (logp - old_logp).clamp(-_LOG_CLAMP, _LOG_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped_branch = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped_branch)
    clip_hit = clipped_branch > unclipped
    dual_hit = torch.zeros_like(clip_hit)
    if clip_c is not None:
        bound = -adv * clip_c
        dual_hit = (adv < 0) & (per_token > bound)
        per_token = torch.where(dual_hit, bound, per_token)

    smode = stats_mode(agg)
    stats_denom = stats_denom_for(agg, denom, stats_denom)
    stats: dict[str, torch.Tensor] = {}
    if is_weights is not None:
        w, stats = given_weight_correction(is_weights, old_logp, behav_logp, mask, smode,
                                           stats_denom)
        per_token = per_token * w
    elif behav_logp is not None:
        w, stats = behaviour_correction(old_logp, behav_logp, tis_cap, mask, level, smode,
                                        stats_denom)
        per_token = per_token * w

    loss = aggregate(per_token, mask, agg, denom)
    with torch.no_grad():
        stats["pg_loss"] = loss.detach()
        stats["clip_frac"] = aggregate(clip_hit.to(mask.dtype), mask, smode, stats_denom)
        stats["dual_clip_frac"] = aggregate(dual_hit.to(mask.dtype), mask, smode, stats_denom)
        stats["ppo_kl"] = aggregate(-log_ratio, mask, smode, stats_denom)
        stats["ratio_mean"] = aggregate(ratio, mask, smode, stats_denom)
        stats["ratio_max"] = _masked_max(ratio, mask)
    return loss, {k: v.detach() for k, v in stats.items()}


def aggregate_entropy(entropy: torch.Tensor, mask: torch.Tensor, agg: str = "token-mean",
                      denom: float | torch.Tensor | None = None) -> torch.Tensor:
    """Entropy [b, T] aggregated like the loss (same mode, same `denom`, so micro-batch
    shares sum to the batch value). The actor loss subtracts ``entropy_coeff`` times this."""
    return aggregate(entropy.float(), mask, agg, denom)
