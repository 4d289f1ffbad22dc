"""verl 0.9.1's policy loss modes (``actor.policy_loss.loss_mode``), as megarl's own functions.

verl selects the actor's policy loss by name from a registry (verl/trainer/ppo/core_algos.py,
``register_policy_loss``, lines 1285-2106 of the 0.9.1 wheel); `POLICY_LOSS_MODES` is that
table under the same names. ``vanilla`` is `losses.ppo_policy_loss` itself, unchanged (clip,
dual clip); every other mode is a function here that turns the four per-token tensors into a
per-token loss matrix and the diagnostics verl reports for it, and one driver,
`policy_loss`, does what all modes share: the off-policy correction and the aggregation.
verl's ``bypass_mode`` entry (its own importance weights, then vanilla or REINFORCE) is
`megarl.algo.bypass_loss`, chosen by ``algorithm.rollout_correction.bypass_mode``.

Tensors as in `losses` ([b, T]; ``logp`` the trained policy, the only one with a gradient;
``old_logp`` the proximal policy; ``behav_logp`` the rollout engine's). Per mode, with
r = exp(logp - old_logp), A the advantage, eps_lo/eps_hi = clip_ratio_low/high:

- ``gspo``:     the sequence ratio s_i = exp(masked mean_t log r), carried per token as
                sg[s_i] * pi / sg[pi] (its gradient is the token's), PPO-clipped with eps
- ``sapo``:     a smooth gate instead of a clip: -A * sigmoid(tau (r - 1)) * 4 / tau, tau =
                tau_pos where A > 0 else tau_neg; always aggregated seq-mean-token-mean
- ``gpg``:      plain policy gradient, -A * logp (no ratio, no clip)
- ``clip_cov``: PPO clip, and besides, a random ``clip_cov_ratio`` share of the tokens whose
                centred covariance (A - mean A)(logp - mean logp) lies in (clip_cov_lb,
                clip_cov_ub) gets no gradient
- ``kl_cov``:   unclipped -A * r, plus ppo_kl_coef * |log r| on the ``kl_cov_ratio`` share of
                tokens with the largest covariance
- ``geo_mean``: GMPO: per sequence, -mean_t(A) * exp(masked mean_t of the log ratio clipped
                to [-eps_lo, eps_hi] on the side A pushes it); the mean over sequences
- ``cispo``:    -sg[clip(r, 1 - eps_lo, 1 + eps_hi)] * A * logp (the clip never kills a
                token's gradient)
- ``dppo_tv``/``dppo_kl``: -A * sg[min(r, c)] * logp on the tokens whose probability moved
                less than eps (total variation |p - p_old|, or the binary KL of p_old and p)
                in the direction A pushes; c = clip_ratio_c (20 when null, verl's fallback)
- ``dro``:      -(A * logp - dro_beta / 2 * (log r)^2)

Composition with the off-policy correction: as for vanilla, the per-token loss is
multiplied by the detached truncated weight w = min(pi_prox / pi_behav, tis_cap)
(`losses.behaviour_weight`, token or sequence level) before aggregation, which is what verl
does with its ``rollout_is_weights`` in every one of these modes except ``geo_mean``: its
loss is per sequence, so each sequence takes the geometric mean of its tokens' weights (at
the sequence level, the sequence's weight itself), as verl does (core_algos.py:1992-1998).
The weight is megarl's own, or the batch's ``rollout_is_weights`` (`is_weights`: verl's
``algorithm.rollout_correction``, `megarl.algo.rollout_correction`) where it has them.

Aggregation: `aggregate` with ``loss_agg_mode`` and the batch ``denom``, so a micro-batch
returns its share, except where verl imposes its own: ``sapo`` (seq-mean-token-mean) and
``geo_mean`` (a mean over sequences); both then divide by the batch's sequence count
(``seq_denom``). Two deliberate differences from verl: geo_mean averages over sequences
(rows with a valid token), where verl's ``torch.mean`` also counts all-masked padding rows
and ignores its global batch size, so its value changed with the micro-batch split and the
padding; and the diagnostics are shares of the batch like vanilla's (token means under
token-mean/token-sum, per-sequence means under the seq-mean modes; `losses`), where verl
averages each micro-batch's token mean.

``clip_cov`` and ``kl_cov`` choose their tokens among the tokens of one call, as verl does:
their loss depends on how a mini-batch is split into micro-batches (a micro-batch's share
then equals verl's call on that micro-batch). clip_cov's choice is random; `policy_loss`
takes the generator to draw it with (the actor loss seeds one from the micro-batch's token
ids, so the ranks of a model that share a micro-batch draw the same tokens).

Stats (detached 0-d tensors, shares like `losses.ppo_policy_loss`'s): ``pg_loss``,
``ratio_mean``, ``ratio_max`` (max, not summed), the correction's (`behaviour_correction`),
and the mode's own in verl's meaning: ``clip_frac`` (verl's pg_clipfrac), ``clip_frac_lower``
(verl's pg_clipfrac_lower: geo_mean's clip where A < 0, dppo's truncation at c; 0 in gspo,
sapo, cispo) and ``ppo_kl`` (mean old_logp - logp; kl_cov's is verl's mean |log r|).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from .aggregate import aggregate, stats_denom_for, stats_mode
from .losses import (_LOG_CLAMP, _masked_max, behaviour_correction, given_weight_correction,
                     ppo_policy_loss)

_GSPO_LOG_MAX = 10.0  # verl clamps gspo's log sequence ratio at 10 (core_algos.py:1590)
_DPPO_TRUNCATION = 20.0  # dppo's c where clip_ratio_c is absent (core_algos.py:1427, 1508)
_SEQ = "seq-mean-token-mean"


@dataclass(frozen=True)
class PolicyLossParams:
    """The hyper-parameters the modes read, with verl 0.9.1's defaults. Config keys:
    ``actor.clip_ratio_low/high`` (null: ``clip_ratio``), ``actor.clip_ratio_c``,
    ``actor.tau_pos/tau_neg`` and ``actor.policy_loss.*`` for the rest."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_c: float | None = 3.0
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    dro_beta: float | None = None  # required by dro: no default there


class _Batch(NamedTuple):
    logp: torch.Tensor      # float32, with the gradient
    old_logp: torch.Tensor  # detached
    adv: torch.Tensor       # detached, [b, T]
    mask: torch.Tensor      # float
    mean: Callable[[torch.Tensor], torch.Tensor]  # a per-token diagnostic -> its share
    generator: torch.Generator | None


def _clamped_log_ratio(b: _Batch) -> torch.Tensor:
    return (b.logp - b.old_logp).clamp(-_LOG_CLAMP, _LOG_CLAMP)


def _local_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean over this call's valid tokens (verl's masked_mean, its 1e-8 included, so a
    covariance at a selection bound falls on the same side as in verl)."""
    return (x * mask).sum() / (mask.sum() + 1e-8)


def _gspo(b: _Batch, p: PolicyLossParams):
    log_ratio = b.logp - b.old_logp
    seq = (log_ratio * b.mask).sum(-1) / b.mask.sum(-1).clamp(min=1)
    # log s_it = sg[log s_i] + logp - sg[logp]: the value of the sequence ratio, the gradient
    # of the token's own log-prob
    log_s = (b.logp - b.logp.detach() + seq.detach().unsqueeze(-1)).clamp(max=_GSPO_LOG_MAX)
    s = torch.exp(log_s)
    unclipped = -b.adv * s
    clipped = -b.adv * s.clamp(1.0 - p.clip_low, 1.0 + p.clip_high)
    stats = {"clip_frac": b.mean((clipped > unclipped).float()),
             "clip_frac_lower": b.logp.new_zeros(()), "ppo_kl": b.mean(-log_ratio)}
    return torch.maximum(unclipped, clipped), stats


def _sapo(b: _Batch, p: PolicyLossParams):
    log_ratio = _clamped_log_ratio(b)
    kw = {"dtype": b.adv.dtype, "device": b.adv.device}
    tau = torch.where(b.adv > 0, torch.as_tensor(p.tau_pos, **kw),
                      torch.as_tensor(p.tau_neg, **kw))
    gate = torch.sigmoid(tau * (torch.exp(log_ratio) - 1.0)) * (4.0 / tau)
    zero = b.logp.new_zeros(())
    return -gate * b.adv, {"clip_frac": zero, "clip_frac_lower": zero,
                           "ppo_kl": b.mean(-log_ratio)}


def _gpg(b: _Batch, p: PolicyLossParams):
    return -b.logp * b.adv, {}


def _clip_cov(b: _Batch, p: PolicyLossParams):
    log_ratio = b.logp - b.old_logp
    ratio = torch.exp(log_ratio)
    unclipped = -b.adv * ratio
    clipped = -b.adv * ratio.clamp(1.0 - p.clip_low, 1.0 + p.clip_high)
    valid = b.mask > 0
    lp = b.logp.detach()
    cov = (b.adv - _local_mean(b.adv, b.mask)) * (lp - _local_mean(lp, b.mask))
    # tokens the PPO clip already stops are no candidates
    candidates = valid & ~(clipped > unclipped) & (cov > p.clip_cov_lb) & (cov < p.clip_cov_ub)
    n_clip = max(int(p.clip_cov_ratio * float(b.mask.sum())), 1)
    idx = torch.nonzero(candidates)
    if len(idx):
        pick = torch.randperm(len(idx), generator=b.generator)[:n_clip]
        idx = idx[pick.to(idx.device)]
    corr = torch.ones_like(b.logp)
    corr[idx[:, 0], idx[:, 1]] = 0.0
    stats = {"clip_frac": b.mean((corr == 0).float()), "ppo_kl": b.mean(-log_ratio)}
    return torch.maximum(unclipped, clipped) * corr, stats


def _kl_cov(b: _Batch, p: PolicyLossParams):
    log_ratio = b.logp - b.old_logp
    loss = -b.adv * torch.exp(log_ratio)
    valid = b.mask > 0
    adv, lp = b.adv[valid], b.logp.detach()[valid]  # row-major, as verl's flat indices
    if adv.numel():
        cov = (adv - adv.mean()) * (lp - lp.mean())
        k = max(1, int(adv.numel() * p.kl_cov_ratio))
        top = torch.nonzero(valid.reshape(-1)).squeeze(-1)[torch.topk(cov, k).indices]
        chosen = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
        chosen[top] = True
        penalty = p.ppo_kl_coef * log_ratio.abs()
        loss = torch.where(chosen.view_as(valid), loss + penalty, loss)
    # verl reports the mean |log r| under ppo_kl for this mode (core_algos.py:1892)
    return loss, {"ppo_kl": b.mean(log_ratio.abs())}


def _geo_mean(b: _Batch, p: PolicyLossParams):
    log_ratio = b.logp - b.old_logp
    bounded = log_ratio.clamp(-p.clip_low, p.clip_high)
    sign = torch.sign(b.adv)
    # the clip only on the side the advantage pushes the ratio (PPO's min, in log space)
    kept = sign * torch.minimum(sign * log_ratio, sign * bounded)
    n = b.mask.sum(-1).clamp(min=1)
    seq_ratio = torch.exp((kept * b.mask).sum(-1) / n)
    seq_adv = (b.adv * b.mask).sum(-1) / n
    seq_loss = (-seq_adv * seq_ratio).unsqueeze(-1).expand_as(b.logp)
    hit = (log_ratio != bounded).float()
    stats = {"clip_frac": b.mean(hit * (b.adv > 0)), "clip_frac_lower": b.mean(hit * (b.adv < 0)),
             "ppo_kl": b.mean(-log_ratio)}
    return seq_loss, stats  # each sequence's loss on its tokens; aggregated per sequence


def _cispo(b: _Batch, p: PolicyLossParams):
    log_ratio = _clamped_log_ratio(b)
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(1.0 - p.clip_low, 1.0 + p.clip_high)
    stats = {"clip_frac": b.mean((ratio != weight).float()),
             "clip_frac_lower": b.logp.new_zeros(()), "ppo_kl": b.mean(-log_ratio)}
    return -weight.detach() * b.adv * b.logp, stats


def _dppo(region: Callable[[_Batch, PolicyLossParams, torch.Tensor, torch.Tensor],
                           torch.Tensor]):
    """A DPPO mode; `region(b, p, prob, old_prob)` is its trust region (bool [b, T]): the
    tokens that keep their gradient."""
    def mode(b: _Batch, p: PolicyLossParams):
        log_ratio = _clamped_log_ratio(b)
        ratio = torch.exp(log_ratio)
        c = _DPPO_TRUNCATION if p.clip_c is None else p.clip_c
        keep = region(b, p, torch.exp(b.logp), torch.exp(b.old_logp)).detach().float()
        loss = -b.adv * ratio.clamp(max=c).detach() * b.logp * keep
        stats = {"clip_frac": b.mean(1.0 - keep),
                 "clip_frac_lower": b.mean((ratio > c).float() * keep),
                 "ppo_kl": b.mean(-log_ratio)}
        return loss, stats
    return mode


def _tv_region(b, p, prob, old_prob):
    moved = prob - old_prob
    return torch.where(b.adv > 0, moved <= p.clip_high, moved >= -p.clip_low)


def _binary_kl_region(b, p, prob, old_prob):
    # KL(Bernoulli(p_old) || Bernoulli(p)): how far the token's own probability moved
    kl = old_prob * (b.old_logp - b.logp) + (1 - old_prob) * torch.log(
        (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
    return torch.where(b.adv > 0, (kl <= p.clip_high) | (prob <= old_prob),
                       (kl <= p.clip_low) | (prob >= old_prob))


def _dro(b: _Batch, p: PolicyLossParams):
    log_ratio = b.logp - b.old_logp
    loss = -(b.logp * b.adv - 0.5 * p.dro_beta * log_ratio.square())
    return loss, {"ppo_kl": b.mean(-log_ratio)}


@dataclass(frozen=True)
class PolicyLossMode:
    """One row of `POLICY_LOSS_MODES`."""

    per_token: Callable | None
    """(batch, params) -> (per-token loss [b, T], stats); None: vanilla, which is
    `losses.ppo_policy_loss` whole."""
    reads: tuple[str, ...]
    """The `PolicyLossParams` fields the mode reads (docs/algorithms.md lists them)."""
    agg: str | None = None
    """The aggregation verl imposes whatever ``loss_agg_mode`` says; None: loss_agg_mode."""
    sequence_weight: bool = False
    """The behaviour weight enters per sequence (the geometric mean of its tokens')."""
    random: bool = False
    """Draws tokens at random: `policy_loss` takes a generator for it."""


_CLIP = ("clip_low", "clip_high")
POLICY_LOSS_MODES: dict[str, PolicyLossMode] = {
    "vanilla": PolicyLossMode(None, (*_CLIP, "clip_c")),
    "gspo": PolicyLossMode(_gspo, _CLIP),
    "sapo": PolicyLossMode(_sapo, ("tau_pos", "tau_neg"), agg=_SEQ),
    "gpg": PolicyLossMode(_gpg, ()),
    "clip_cov": PolicyLossMode(_clip_cov, (*_CLIP, "clip_cov_ratio", "clip_cov_lb",
                                           "clip_cov_ub"), random=True),
    "kl_cov": PolicyLossMode(_kl_cov, ("kl_cov_ratio", "ppo_kl_coef")),
    "geo_mean": PolicyLossMode(_geo_mean, _CLIP, agg=_SEQ, sequence_weight=True),
    "cispo": PolicyLossMode(_cispo, _CLIP),
    "dppo_tv": PolicyLossMode(_dppo(_tv_region), (*_CLIP, "clip_c")),
    "dppo_kl": PolicyLossMode(_dppo(_binary_kl_region), (*_CLIP, "clip_c")),
    "dro": PolicyLossMode(_dro, ("dro_beta",)),
}
"""verl 0.9.1's registered policy losses (less bypass_mode: `megarl.algo.bypass_loss`), by
verl's names."""


def mode_entry(mode: str) -> PolicyLossMode:
    if mode not in POLICY_LOSS_MODES:
        raise ValueError(f"unknown policy loss_mode {mode!r}; choose from "
                         f"{', '.join(POLICY_LOSS_MODES)}")
    return POLICY_LOSS_MODES[mode]


def check_params(mode: str, p: PolicyLossParams) -> None:
    """Refuse hyper-parameters `mode` cannot use (verl asserts the same, at the first step)."""
    entry = mode_entry(mode)
    if "clip_low" in entry.reads and (not 0 <= p.clip_low < 1 or p.clip_high < 0):
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {p.clip_low}, "
                         f"{p.clip_high}")
    positive = {"tau_pos": p.tau_pos, "tau_neg": p.tau_neg, "dro_beta": p.dro_beta,
                "clip_cov_ratio": p.clip_cov_ratio, "kl_cov_ratio": p.kl_cov_ratio}
    for name in entry.reads:
        if name in positive and (positive[name] is None or positive[name] <= 0):
            raise ValueError(f"loss_mode {mode} needs {name} > 0, got {positive[name]}")
    if mode == "clip_cov" and not p.clip_cov_lb < p.clip_cov_ub:
        raise ValueError(f"clip_cov needs clip_cov_lb < clip_cov_ub, got {p.clip_cov_lb}, "
                         f"{p.clip_cov_ub}")


def token_losses(mode: str, logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor,
                 mask: torch.Tensor, params: PolicyLossParams = PolicyLossParams(),
                 generator: torch.Generator | None = None
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`mode`'s per-token loss matrix [b, T] before the off-policy weight and aggregation,
    and its stats as per-micro-batch token means (not vanilla: its matrix lives inside
    `ppo_policy_loss`)."""
    entry = mode_entry(mode)
    if entry.per_token is None:
        raise ValueError("vanilla's per-token loss is losses.ppo_policy_loss's own")
    b = _prepare(logp, old_logp, adv, mask, lambda v: aggregate(v, mask.float()), generator)
    return entry.per_token(b, params)


def _prepare(logp, old_logp, adv, mask, mean, generator) -> _Batch:
    logp = logp.float()
    adv = adv.detach().float()
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)
    return _Batch(logp, old_logp.detach().float(), adv.expand_as(logp), mask.to(logp.dtype),
                  mean, generator)


def policy_loss(mode: str, logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor,
                mask: torch.Tensor, params: PolicyLossParams = PolicyLossParams(), *,
                behav_logp: torch.Tensor | None = None, tis_cap: float | None = None,
                level: str = "token", agg: str = "token-mean",
                denom: float | torch.Tensor | None = None,
                stats_denom: float | torch.Tensor | None = None,
                seq_denom: float | torch.Tensor | None = None,
                generator: torch.Generator | None = None,
                is_weights: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`mode`'s policy loss -> (loss, stats); see the module docstring.

    `agg`, `denom`, `stats_denom`, `behav_logp`, `tis_cap`, `level` as in
    `losses.ppo_policy_loss`. `seq_denom`: the batch's sequence count (`global_denom(mask,
    "seq-mean-token-mean")`), the normaliser of the modes that aggregate per sequence (sapo,
    geo_mean) when `denom` is a batch's; None there means `stats_denom` when that already
    counts sequences (the seq-mean modes). `generator`: clip_cov's random draw (None: torch's
    global generator, as verl). `is_weights` [b, T]: importance weights given with the batch
    (verl's rollout_is_weights), used instead of megarl's own behaviour weight."""
    entry = mode_entry(mode)
    check_params(mode, params)
    if entry.per_token is None:
        return ppo_policy_loss(logp, old_logp, adv, mask, params.clip_low, params.clip_high,
                               params.clip_c, behav_logp=behav_logp, tis_cap=tis_cap, agg=agg,
                               denom=denom, level=level, stats_denom=stats_denom,
                               is_weights=is_weights)
    smode = stats_mode(agg)
    stats_denom = stats_denom_for(agg, denom, stats_denom)
    mask = mask.float()
    b = _prepare(logp, old_logp, adv, mask,
                 lambda v: aggregate(v.float(), mask, smode, stats_denom), generator)
    per_token, stats = entry.per_token(b, params)

    if is_weights is not None or behav_logp is not None:
        if is_weights is not None:
            w, tis_stats = given_weight_correction(is_weights, b.old_logp, behav_logp, mask,
                                                   smode, stats_denom)
        else:
            w, tis_stats = behaviour_correction(b.old_logp, behav_logp, tis_cap, mask, level,
                                                smode, stats_denom)
        if entry.sequence_weight:  # one weight per sequence: its tokens' geometric mean
            n = mask.sum(-1, keepdim=True).clamp(min=1)
            # verl's 1e-10 (core_algos.py:1996): an IcePop weight of 0 gives a tiny mean
            log_w = torch.where(mask > 0, torch.log(w + 1e-10), 0.0)
            w = torch.exp(log_w.sum(-1, keepdim=True) / n).expand_as(w)
        per_token = per_token * w
        stats.update(tis_stats)

    loss_agg, loss_denom = agg, denom
    if entry.agg is not None:
        loss_agg = entry.agg
        if denom is not None:
            if seq_denom is None and smode != _SEQ:
                raise ValueError(f"loss_mode {mode} aggregates per sequence: with a batch "
                                 f"denom under {agg!r} it needs seq_denom "
                                 f"(global_denom(batch_mask, {_SEQ!r}))")
            loss_denom = stats_denom if seq_denom is None else seq_denom
    loss = aggregate(per_token, mask, loss_agg, loss_denom)
    with torch.no_grad():
        ratio = torch.exp(_clamped_log_ratio(b))
        stats["pg_loss"] = loss.detach()
        stats["ratio_mean"] = b.mean(ratio)
        stats["ratio_max"] = _masked_max(ratio, mask)
    return loss, {k: v.detach() for k, v in stats.items()}


def generator_for(input_ids: torch.Tensor | None) -> torch.Generator | None:
    """A CPU generator seeded from a micro-batch's token ids, for clip_cov's draw.

    Every rank that computes the loss of one micro-batch (the tensor-parallel ranks of the
    last pipeline stage) must draw the same tokens, or their gradients disagree; the token
    ids are what they all hold bit for bit, and they change from micro-batch to micro-batch,
    unlike a process RNG's state, which other code consumes differently on each rank."""
    if input_ids is None:
        return None
    ids = input_ids.detach().reshape(-1).to("cpu", torch.int64)
    mix = (ids * torch.arange(1, ids.numel() + 1, dtype=torch.int64)).sum()  # int64 wraps
    return torch.Generator().manual_seed(int(mix) & (2**63 - 1))


__all__ = ["POLICY_LOSS_MODES", "PolicyLossMode", "PolicyLossParams", "check_params",
           "generator_for", "mode_entry", "policy_loss", "token_losses"]
